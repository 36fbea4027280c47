"""The parallel step: spread a denoiser's forward over the processes of a `torchrun` job.

Runs last but one (after compile and offload), so everything it adds wraps the compiled regions
from outside. Two mechanisms, both per region of the plan's ``parallel`` section:

- **Sequence parallelism** (Ulysses / ring) is diffusers' own context parallelism, installed
  from the model's context-parallel plan (`sequence`); the engine's fa3 kernel takes part through
  diffusers' templated attention (`fa3_cp`).
- **CFG parallelism** diffusers does not have for these pipelines, so it is a small hook here
  (`cfg`): each rank of a cfg pair computes one guidance branch and the outputs are exchanged.

Undo is exact: every hook is removed by name, registries and attributes the step created
are deleted, the processors' and the model's context-parallel config go back to what they
were. The process groups of the device mesh stay (a process-level resource, reused by the
next apply). docs/multi-gpu.md describes the degrees, their costs and the measured speed-ups.
"""

from .cfg import CFG_HOOK
from .fa3_cp import fa3_context_parallel_attention
from .sequence import FRESH_HOOK, UNEVEN_HOOK
from .step import cfg_parallel_active, parallel_step

__all__ = ["parallel_step", "cfg_parallel_active", "CFG_HOOK", "FRESH_HOOK", "UNEVEN_HOOK",
           "fa3_context_parallel_attention"]
