"""The servers' protocols: OpenAI-compatible HTTP (`openai/`), OpenAI's stateful APIs with a
WebSocket mode (`openai_ws/`: Responses, Realtime), cadenza's own WebSocket sessions (`sessions/`),
the tokenizer routes, /metrics, the playground, and `server.py`, which runs it all under uvicorn.

May import: cluster/, engine/, runtime/ and everything below. Only the CLI and the package's entry
points import this layer.
"""
