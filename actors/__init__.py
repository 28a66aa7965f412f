"""The engine's five actors and the messages between them.

`ingress.py` (validate, template, tokenize, admit), `scheduler.py` over `scheduler_core.py` (which
requests run how many tokens next; `request_state.py` is its record of one request),
`cache_manager.py` (KV block ids, reference counts, the prefix cache), `runner.py` (steps on the
model, off the event loop) and `detokenizer.py` (clean text, stop strings, finishing). `base.py`
is the actor shell: a bounded typed inbox, a named lifecycle, supervision. `messages.py` holds every
message, frozen dataclasses grouped by the actor that receives them. Actors never import each
other: channels are injected by the engine.

May import: runner/ and every layer below it (speculative/, samplers/, policies/, models/, ...,
config/, the root's plain data). Never engine/, runtime/ or anything above.
"""
