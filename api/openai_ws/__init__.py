"""OpenAI's stateful APIs with a WebSocket mode: `responses.py` (/v1/responses, over HTTP and
WebSocket; `responses_protocol.py` its request and events) and `realtime.py` (/v1/realtime)."""
