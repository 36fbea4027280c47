"""The activation peak of a call on CPU, measured: the bytes of the tensors the call makes and
holds at once (each op's new output storages counted when made and uncounted when freed, by a
weakref finalizer). Sizes, not an allocator's numbers: what the offload plan's reserves estimate."""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LivePeak(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._alive:  # a view of an input, or counted already
                continue
            self._alive.add(key)
            n = storage.nbytes()
            self.current += n
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key, n)
        return out

    def _freed(self, key: int, n: int) -> None:
        self._alive.discard(key)
        self.current -= n


def peak_bytes(fn) -> int:
    """Run `fn()` (eager, no grad) and return the peak bytes of the tensors it made and held."""
    gc.collect()
    live = LivePeak()
    with torch.no_grad(), live:
        fn()
    return live.peak
