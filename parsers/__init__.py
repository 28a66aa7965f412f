"""Parsers of what a model writes: its reasoning apart from its answer (`reasoning.py`).

A family writes its reasoning its own way (Qwen3 and DeepSeek-R1 between `<think>` tags); a parser
knows one way, streams or splits whole outputs, and is a plugin like a sampler: built-ins
register through `register_reasoning_parsers` (`builtins.py`), a third-party package adds its own
the same way, and the deployment picks one by name (`server.reasoning_parser`) or lets the chat
template's text choose (`parser_for_template`).

May import: plugins/, config/ and the root's plain data.
"""
