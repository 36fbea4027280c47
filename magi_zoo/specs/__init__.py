"""Specs: HOW to run a model per GPU, as validated data (TOML files + pydantic models).

Each plan section is one pydantic model registered in `section.SECTIONS`; importing this
package registers the built-in ones (attention, compile, precision).
"""

from pathlib import Path

from .attention_spec import AttentionSpec
from .compile_spec import VALID_MODES, TorchCompileSpec
from .gpu_profiles import GPU_CHOICES, PROFILES, GpuProfile, get_profile
from .plan import LAYER_ORDER, PlanLayer, SpecFile, as_layers, with_backend
from .precision_spec import MATMUL_FORMATS, PrecisionSpec
from .parallel_spec import ParallelSpec  # registers the parallel section
from .recompute_spec import RecomputeSpec
from .offload_spec import OFFLOAD_MODES, OffloadSpec  # registers the offload section
from .section import SECTIONS, SectionSpec, register_section
from .step_cache_spec import StepCacheSpec  # noqa: F401  (registers the step_cache section)
from .cuda_graph_spec import CudaGraphSpec  # noqa: F401  (registers the cuda_graphs section)
from .memory_format_spec import MemoryFormatSpec  # noqa: F401  (registers the memory_format section)

SPEC_DIR = Path(__file__).parent


def spec_path(name: str) -> Path:
    """Path of a spec file shipped with the package (e.g. 'wan.toml')."""
    return SPEC_DIR / name


__all__ = ["TorchCompileSpec", "AttentionSpec", "PrecisionSpec", "RecomputeSpec", "MATMUL_FORMATS", "SectionSpec", "SECTIONS", "register_section", "VALID_MODES",
           "GpuProfile", "PROFILES", "GPU_CHOICES", "get_profile", "PlanLayer", "SpecFile", "LAYER_ORDER",
           "as_layers", "with_backend", "spec_path", "SPEC_DIR"]
