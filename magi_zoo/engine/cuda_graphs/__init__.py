"""The cuda_graphs step: whole calls of a method captured in CUDA graphs and replayed.

`graphed` holds `GraphedCall` (capture per input signature, replay, stats) and `bypassed`
(run the methods themselves for a while, e.g. to time submodules with hooks); `step` holds
`cuda_graphs_step` (where graphs go, and what the steps before rule out).
"""

from .graphed import GraphedCall, bypassed, graphed
from .step import conflict, cuda_graphs_step

__all__ = ["GraphedCall", "bypassed", "graphed", "conflict", "cuda_graphs_step"]
