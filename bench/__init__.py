"""`cadenza bench`: seeded workloads, peer engines, machine ceilings, serving load and quiet checks.

    cadenza bench throughput --num-requests 16 --compare hf
    cadenza bench latency
    cadenza bench serve --request-rates 1 4 inf

Grouped by what each part measures, bottom to top (a subpackage imports only those above it in
this list, and its own modules; each `__init__.py` says which):

- `common/`: what every bench shares: the seeded workload, the quiet-machine check, the device and
  its clock, cadenza behind one `run(workload)` call, tables and JSON, the engine flags and the
  process set-up;
- `peers/`: the engines cadenza is compared with, llama.cpp's own binaries and transformers;
- `offline/`: one engine in this process: `cadenza bench throughput` and `latency`, the machine's
  ceilings, the model step alone;
- `features/`: what one engine feature costs or gains: speculative decoding, structured outputs,
  long sessions;
- `profiling/`: where the time goes: torch.profiler over a model step, py-spy over a whole run;
- `serving/`: a launched `cadenza serve` under load (`cadenza bench serve`, routers,
  disaggregation) and scale-out;
- `cpu/`: the CPU itself: each CPU kind against llama.cpp, the engine beside a busy neighbour.

`cli.py` (the `bench` subcommands) is the top: it imports the others, and nothing imports it.
"""
