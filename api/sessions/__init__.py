"""cadenza's own WebSocket session protocol: `websocket.py` (/v1/sessions), `protocol.py` (its
messages), and the conversation core every conversation API shares (`core.py`, `conversation.py`)."""
