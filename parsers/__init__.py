"""Parsers of what a model writes: its reasoning apart from its answer (`reasoning.py`) and its
tool calls in its family's syntax (`tool_calls.py`, with the schemas that force one:
`tool_schemas.py`); gpt-oss's harmony, which writes both as messages on channels, has both
(`harmony.py`).

A family writes these its own way (Qwen3 and DeepSeek-R1 reason between `<think>` tags; Qwen calls
tools in `<tool_call>` JSON, Qwen3-Coder in XML, Mistral after `[TOOL_CALLS]`; gpt-oss on the
analysis channel, and calls to `functions.NAME` on the commentary one); a parser knows one way,
streams or splits whole outputs, and is a plugin like a sampler: built-ins register through
`register_reasoning_parsers` and `register_tool_parsers` (`builtins.py`), a third-party package
adds its own the same way, and the deployment picks one by name (`server.reasoning_parser`,
`server.tool_parser`) or lets the chat template's text choose. A format written in special tokens
says so (`markers.FormatTokens`): the API then keeps them in the text it parses.

May import: plugins/, config/ and the root's plain data.
"""
