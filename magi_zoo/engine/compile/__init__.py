"""The compile step and its cache.

- `step`: install a resolved compile spec on each (module, method) of the plan in place
  (`compile_step`), take it back (`uninstall_all`), and say what a spec implies (CUDA
  graphs, inductor's graph partition at custom-op boundaries);
- `cache`: the compile cache -- torch's compile artifacts and our kernels' compiled files
  kept across processes, keyed by the plan and the environment (`CompileCache`).
"""

from .cache import ENV_VAR, CompileCache, environment_fields, resolve_cache_dir
from .step import (boundary_ops_for, compile_step, compiled_methods, cuda_graphs_by, install, installed,
                   partition_at_boundaries, uninstall_all)

__all__ = ["compile_step", "install", "uninstall_all", "installed", "compiled_methods", "cuda_graphs_by",
           "boundary_ops_for", "partition_at_boundaries",
           "CompileCache", "resolve_cache_dir", "environment_fields", "ENV_VAR"]
