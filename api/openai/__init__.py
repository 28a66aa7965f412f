"""OpenAI-compatible HTTP routes: `completions.py` (/v1/completions, /v1/chat/completions),
`embeddings.py` (/v1/embeddings); their request models (`protocol.py`), OpenAPI shapes
(`schema.py`, `request_rules.py`) and tool calling (`tool_schemas.py`; the formats are parsers/tool_calls.py)."""
