"""Adapter graph preparation: model-specific changes that make a module tree compile well
(same values, better graphs), declared by the adapter and applied as the first step.

Examples: giving the first of a stack of repeated blocks the same input layout as the
others (one compile instead of two), or splitting one `forward` into named methods that
the plan can compile differently (a prompt-length prefill and a fixed-shape decode step).
They run before the plan is resolved, because a plan key may name a method they add.
`step` holds `Preparation` and `prepare` (the step); `rewrites` the rewrites preparations use.
"""

from .rewrites import instance_forwards, processor_preparation, swap_processors
from .step import Preparation, prepare

__all__ = ["Preparation", "prepare", "instance_forwards", "processor_preparation", "swap_processors"]
