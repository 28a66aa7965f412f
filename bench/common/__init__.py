"""What every bench shares: `workload` (the seeded requests), `quiet` (other processes' CPU share,
from /proc), `device` (the device, its clock, the engine settings the work needs), `engines`
(cadenza behind `run(workload) -> EngineRun`), `report` (tables, the JSON file), `setup` (the
engine flags shared with `cadenza serve`, the process's logging and quiet-machine policy).

Imports: nothing of the bench outside `common/` (the lowest part: every other part may import it).
"""
