"""magi_zoo: large generative models with per-model compile specs and one engine.

    import magi_zoo
    pipe = magi_zoo.load("wan2.1", gpu="h100")
    video = pipe(prompt="a corgi surfing", num_frames=81)
    print(pipe.report())

Importing this package is cheap: it imports neither diffusers nor transformers and does
not initialise CUDA. Adapters load lazily when a model is asked for.
"""

from .engine import PlanError, apply, register_custom_op, remove
from .specs import AttentionSpec, GpuProfile, PlanLayer, PrecisionSpec, SpecFile, TorchCompileSpec, get_profile
from .zoo import ZooPipeline, list_models, load

__version__ = "0.1.0"

__all__ = ["TorchCompileSpec", "AttentionSpec", "PrecisionSpec", "remove", "PlanLayer", "SpecFile", "GpuProfile", "get_profile", "apply",
           "register_custom_op", "list_models", "load", "ZooPipeline", "PlanError", "__version__"]
