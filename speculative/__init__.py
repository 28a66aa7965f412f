"""Speculative decoding: proposers guess a request's next tokens, the model verifies them in one pass.

`base.py` is the proposer contract (a plugin kind), `ngram.py` and `suffix.py` the built-in
proposers, `policy.py` the scheduler's per-request switch and adaptive token count, `verify.py`
the exact acceptance rule. docs/speculative.md describes the whole feature.

The runner's side is `speculator.py` and `sizing.py`; `draft.py` drafts with a second model
that the runtime builds for it (`ProposerContext.load_draft`).

May import: samplers/ and everything below. runner/, actors/ and runtime/ import it.
"""
