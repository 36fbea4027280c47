"""The card's side of streaming: the pools of device buffers streamed units run on, each
streamed unit's state, and the allocator statistics refit reads.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from .arena import ALIGN
from .units import UnitSpec


def layout_offsets(layout: tuple) -> tuple[list[int], int]:
    """Byte offsets of a layout's tensors packed in one flat buffer (each aligned), and its size."""
    offs, n = [], 0
    for shape, dtype in layout:
        offs.append(n)
        n += (math.prod(shape) * dtype.itemsize + ALIGN - 1) // ALIGN * ALIGN
    return offs, n


class BufferPool:
    """A pool of device buffers (slots) shared by the streamed units of one phase (a
    one-of-a-kind unit has its own). A slot is one flat byte buffer of the pool's largest
    unit; a unit runs on views of it laid out like its weights."""

    def __init__(self, label: str, nbytes: int, n_slots: int, transient: bool, phase: str):
        self.label, self.nbytes, self.transient, self.phase = label, nbytes, transient, phase
        self.slots: list[torch.Tensor | None] = [None] * n_slots
        self.views: dict[tuple[int, tuple], list[torch.Tensor]] = {}  # (slot, layout) -> its tensor views
        self.free = collections.deque(range(n_slots))
        self.free_event: list[Any] = [None] * n_slots  # event after which the slot may be overwritten

    def drop(self, i: int | None = None) -> None:
        """Forget slot i's buffer (every slot's when None): freed once its last view goes."""
        for k in range(len(self.slots)) if i is None else (i,):
            self.slots[k] = None
            self.free_event[k] = None
        self.views = {key: v for key, v in self.views.items() if i is not None and key[0] != i}

    def bind(self, i: int, layout: tuple) -> list[torch.Tensor]:
        """Slot i's buffer seen as tensors of `layout` (cached while the buffer lives)."""
        key = (i, layout)
        if key not in self.views:
            buf, (offs, _) = self.slots[i], layout_offsets(layout)
            with torch.inference_mode(False), torch.no_grad():
                # Plain tensors even inside inference_mode: the parameters must keep the same
                # dispatch keys call after call, or dynamo's guards would see a new tensor kind.
                self.views[key] = [buf[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                                   for o, (shape, dtype) in zip(offs, layout)]
        return self.views[key]


class StreamedUnit:
    """A unit whose weights stream: its host copy, its pool, the slot it holds and the event
    that says its copy is done."""

    def __init__(self, spec: UnitSpec, group: BufferPool, host: list[torch.Tensor]):
        self.spec, self.group, self.host = spec, group, host
        self.handles: list[Any] = []  # its pre/post hooks (removed when a refit makes it resident)
        self.slot: int | None = None
        self.ready: Any = None  # event recorded after its copy
        self.checks = 0
        self.holds = 0  # open `hold()` blocks: the weights stay on the card between calls


class DeviceMemory:
    """The CUDA allocator's statistics, as refit reads them (tests substitute a fake: a CPU
    run has no allocator statistics)."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
