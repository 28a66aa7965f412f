"""The engines cadenza is compared with, run the way their users run them: llama.cpp's own binaries
on a GGUF (`llamacpp_build` builds them per CPU kind, `llamacpp` names the files at each precision,
`llamacpp_binaries` for latency, `llamacpp_server` for throughput) and transformers (`hf`:
`generate`, its static cache under `torch.compile`, continuous batching).

Imports: `common/` only. Measures nothing by itself: `offline/` and `cpu/` time these peers.
"""
