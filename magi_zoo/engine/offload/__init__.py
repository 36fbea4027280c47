"""The offload step: keep what fits on the card, stream the rest from pinned host memory.

One module per job (docs/offload.md describes the design):

- `plan`      what a plan is: `Unit`, `OffloadPlan`, `OffloadPlanError` (plain data)
- `planner`   which units stay resident under the budget (`plan_offload`; pure, no torch)
- `schedule`  when each copy starts, and the simulated wait (`prefetch_schedule`, `simulate`)
- `units`     the units in a module tree, their tensors and sizes (`find_units`, `plan_units`)
- `arena`     pinned host memory for streamed weights (`HostArenas`, `check_host_memory`)
- `device`    the device buffer pools streamed units run on
- `streaming` the stream runtime: hooks, copies, phase changes (`OffloadRuntime`)
- `measure`   what a real call measures: `profile_units`, `refit`
- `describe`  the plan as text for `magi-zoo spec` (`describe_plan`)
- `step`      `offload_step`, and the handles on what it installed (`runtime`, `streams`, `hold`)
"""

from .arena import HostArenas, available_host_bytes, check_host_memory
from .describe import describe_plan
from .measure import profile_units, refit
from .plan import GIB, POOL_SEP, OffloadPlan, OffloadPlanError, Unit, pool_of, size
from .planner import evictions, phase_activations, plan_offload
from .schedule import prefetch_schedule, simulate
from .step import hold, offload_step, runtime, streams
from .streaming import OffloadCounters, OffloadRuntime
from .units import UnitSpec, find_units, plan_units, planner_settings, resident_bytes, streaming_plan

__all__ = ["HostArenas", "available_host_bytes", "check_host_memory", "describe_plan", "profile_units", "refit",
           "GIB", "POOL_SEP", "OffloadPlan", "OffloadPlanError", "Unit", "pool_of", "size", "evictions",
           "phase_activations", "plan_offload", "prefetch_schedule", "simulate", "hold", "offload_step", "runtime",
           "streams", "OffloadCounters", "OffloadRuntime", "UnitSpec", "find_units", "plan_units",
           "planner_settings", "resident_bytes", "streaming_plan"]
