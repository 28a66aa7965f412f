"""The plugin hooks: `hookspecs.py` (the hooks a cadenza plugin may implement, and the
`hookimpl` marker) and `errors.py` (what loading and resolving plugins raise). This layer knows no
plugin kind: each kind's contract lives with the kind (attention_backends/, samplers/,
policies/, speculative/, kv_connectors/), and runtime/ loads and resolves them all.

May import: kernels/, threads/, config/ and the root's plain data (today it imports none).
"""
