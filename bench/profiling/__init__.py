"""Where the time goes: `profile_step` (torch.profiler over `ModelRunner.execute`, by part of the
model and by aten op) and `pyspy_summary` (a py-spy profile of a whole run, by part of the engine).

Imports: `common/` and `offline/` (the model step).
"""
