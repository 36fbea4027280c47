"""The activation peak of a call on CPU, measured: the bytes of the tensors the call makes and
holds at once, by the recompute step's `measure_peak` (`LiveBytes`: each op's new output
storages counted when made and uncounted when freed). Sizes, not an allocator's numbers: what
the offload plan's reserves estimate."""

from __future__ import annotations

import torch

from magi_zoo.engine.recompute import measure_peak


def peak_bytes(fn) -> int:
    """Run `fn()` (eager, no grad) and return the peak bytes of the tensors it made and held."""
    with torch.no_grad():
        return measure_peak(fn)[1]
