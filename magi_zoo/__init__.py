"""magi_zoo: large generative models with per-model compile specs and one engine.

    import magi_zoo
    pipe = magi_zoo.load("wan2.1", gpu="h100")
    video = pipe(prompt="a corgi surfing", num_frames=81)
    print(pipe.report())

Importing this package is cheap: it imports neither torch, diffusers nor transformers and
does not initialise CUDA. The public names below load their module on first use (PEP 562),
so `magi-zoo --version` / `--help` print before torch is imported; adapters load lazily
when a model is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy names are, for readers and type checkers
    from .engine import PlanError, apply, register_custom_op, remove
    from .specs import (AttentionSpec, GpuProfile, PlanLayer, PrecisionSpec, SpecFile, TorchCompileSpec,
                        get_profile)
    from .zoo import ZooPipeline, list_models, load

__version__ = "0.1.0"

# public name -> the submodule that defines it (imported on first access)
_LAZY: dict[str, str] = {
    **dict.fromkeys(("PlanError", "apply", "register_custom_op", "remove"), "engine"),
    **dict.fromkeys(("AttentionSpec", "GpuProfile", "PlanLayer", "PrecisionSpec", "SpecFile", "TorchCompileSpec",
                     "get_profile"), "specs"),
    **dict.fromkeys(("ZooPipeline", "list_models", "load"), "zoo"),
}

__all__ = ["TorchCompileSpec", "AttentionSpec", "PrecisionSpec", "remove", "PlanLayer", "SpecFile", "GpuProfile", "get_profile", "apply",
           "register_custom_op", "list_models", "load", "ZooPipeline", "PlanError", "__version__"]


def __getattr__(name: str):
    """A public name, or a submodule (`magi_zoo.engine`), imported on first access."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
