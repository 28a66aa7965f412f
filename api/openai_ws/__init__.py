"""OpenAI's stateful APIs with a WebSocket mode: `responses.py` (/v1/responses, over HTTP and
WebSocket; `responses_protocol.py` its request, `responses_items.py` its input and output items,
`responses_output.py` its output events) and `realtime.py` (/v1/realtime)."""
