"""Random initialisation of published-size models in host memory, on every core.

Benchmarks build models with random weights at their published sizes (no download). On a
card that is fast; in host memory -- where a model that must stream its weights is built
(weight offload) -- torch's CPU random fills (`uniform_`, `normal_`) run on one thread
against the default generator: ~0.2 G values/s, so a 20 G-parameter pipeline (Wan2.1-I2V-14B
with UMT5-XXL) spends minutes initialising before anything is measured.

`parallel_fills()` splits each large CPU fill into pieces that threads fill at once (torch
releases the GIL inside the op), each piece from its own generator seeded from the default
generator. The distribution of every fill is unchanged (same op, same arguments); the values
differ from a one-thread fill but are reproducible for a given `torch.manual_seed` and thread
count, as any random init is. Modules' own init code (kaiming, normal, trunc-normal, ...) runs
as written: the mode only changes how the fills it calls are executed.

Where a CUDA device is present (`via="cuda"`, what `init_on` picks for host builds on a GPU
machine), each piece is drawn on the card from a CUDA generator and copied back: a CPU thread
draws ~0.06 G bf16 values/s (measured: a Wan2.1-T2V-1.3B pipeline, 7.2 G values, 63 s of
fills on 2 cores), the card draws them at memory speed and the copy back runs at the host's
copy rate. Pieces are at most `MAX_PIECE` values, so the card holds a few hundred MB at a time
(the weight-offload benchmarks build under a hard memory cap).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..engine.compat.torch import TorchDispatchMode

MIN_NUMEL = 1 << 22  # below ~4 M values a fill takes milliseconds: not worth the threads
MAX_PIECE = 1 << 25  # values per piece drawn on a card (64 MiB in bf16) before the copy back
# Dispatch level, not torch-function level: `nn.init.kaiming_uniform_` & co. are themselves
# torch-function overridable, so a function mode would see them and not the fills inside.
_FILLS = {torch.ops.aten.uniform_.default: "uniform_", torch.ops.aten.normal_.default: "normal_"}


def _workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class _ParallelFills(TorchDispatchMode):
    def __init__(self, pool: ThreadPoolExecutor, workers: int, via: torch.device | None = None):
        super().__init__()
        self.pool, self.workers, self.via = pool, workers, via

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        t = args[0] if args else None
        if (func in _FILLS and isinstance(t, torch.Tensor) and t.device.type == "cpu"
                and t.numel() >= MIN_NUMEL and t.is_contiguous() and kwargs.get("generator") is None):
            kwargs.pop("generator", None)
            # detach: the pieces are filled from worker threads, whose grad mode is their own.
            flat = t.detach().view(-1)
            n = min(self.workers, t.numel() // (MIN_NUMEL // 4))
            if self.via is not None:  # drawn on the card: pieces bounded by what it may hold at once
                n = max(n, -(-flat.numel() // MAX_PIECE))
            step = -(-flat.numel() // n)
            # One draw from the default generator seeds the pieces: reproducible under
            # torch.manual_seed, and the next fill's seeds differ.
            base = int(torch.randint(0, 2 ** 62, (1,)).item())
            method = _FILLS[func]

            def fill(i: int) -> None:
                # The Tensor method (not the op overload) releases the GIL while it fills.
                piece = flat[i * step:(i + 1) * step]
                with torch.no_grad():
                    if self.via is None:
                        g = torch.Generator().manual_seed(base + i)
                        getattr(piece, method)(*args[1:], generator=g, **kwargs)
                    else:
                        g = torch.Generator(device=self.via).manual_seed(base + i)
                        drawn = torch.empty(piece.shape, dtype=piece.dtype, device=self.via)
                        piece.copy_(getattr(drawn, method)(*args[1:], generator=g, **kwargs))

            list(self.pool.map(fill, range(n)))
            return t
        return func(*args, **kwargs)


@contextlib.contextmanager
def parallel_fills(workers: int | None = None, via: torch.device | str | None = None):
    """Within the block, large CPU `uniform_` / `normal_` fills (without an explicit
    generator) run on `workers` threads (default: the cores this process may use); with
    `via` (a device, e.g. "cuda"), each piece is drawn there and copied into host memory."""
    workers = workers or _workers()
    via = torch.device(via) if via is not None else None
    if workers <= 1 and via is None:
        yield
        return
    with ThreadPoolExecutor(workers) as pool, _ParallelFills(pool, workers, via):
        yield
