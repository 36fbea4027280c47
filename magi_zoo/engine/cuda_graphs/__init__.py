"""The cuda_graphs step: whole calls of a method captured in CUDA graphs and replayed.

`graphed` holds `GraphedCall` (capture per input signature, replay, stats); `step` holds
`cuda_graphs_step` (where graphs go, and what the steps before rule out).
"""

from .graphed import GraphedCall, graphed
from .step import conflict, cuda_graphs_step

__all__ = ["GraphedCall", "graphed", "conflict", "cuda_graphs_step"]
