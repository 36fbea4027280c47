"""Host memory for streamed weights: the pinned arenas their copies live in between uses
(`HostArenas`), and the check that the host can hold them before anything moves.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .plan import GIB

ALIGN = 256  # byte alignment of each tensor inside a host arena or a device buffer (inductor's)


def available_host_bytes() -> int | None:
    """Memory the host can still give (psutil, else /proc/meminfo; None if unknown)."""
    try:
        import psutil  # lazy: an optional dependency (/proc/meminfo below without it)

        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(need: int, *, already_on_host: int = 0) -> None:
    """Refuse a plan whose pinned host buffers the host cannot hold (pinned memory cannot be
    swapped: running out would stall the whole machine, not just this process)."""
    avail = available_host_bytes()
    if avail is None:
        return
    extra = need - already_on_host  # weights already in host memory are copied, then freed, unit by unit
    if extra > avail:
        raise MemoryError(
            f"weight streaming needs {need / GIB:.1f} GiB of pinned host memory; this host has "
            f"{avail / GIB:.1f} GiB available ({already_on_host / GIB:.1f} GiB of it already held by the "
            "weights). Raise memory_budget_gib (fewer streamed blocks), use a host with more memory, "
            "or free memory first")


class HostArenas:
    """Host memory for streamed weights, in arenas of `ARENA` bytes packed first-fit.

    Why arenas: torch's pinned-memory allocator rounds every request up to a power of two,
    so one pinned buffer per 0.75 GiB Wan block would take 1 GiB (a third wasted over 24
    blocks). Arenas of exactly 2^30 bytes waste only their tails; a tensor larger than half
    an arena gets its own buffer (e.g. UMT5's 1.96 GiB embedding: a 2 GiB one)."""

    ARENA = 1 << 30

    def __init__(self, pinned: bool, total: int = ARENA):
        self.pinned = pinned
        # A model smaller than an arena gets one buffer of the next power of two above it.
        self.arena = min(self.ARENA, 1 << max(total - 1, 1).bit_length())
        self.buffers: list[torch.Tensor] = []
        self._free: list[int] = []  # free bytes at the end of each arena (-1: a dedicated buffer)
        self.bytes = 0  # host bytes held (what the host check counts)

    @staticmethod
    def rounded(sizes: Sequence[int], pinned: bool) -> int:
        """Host bytes `take` will hold for these tensor sizes (the same packing, no memory)."""
        arenas = HostArenas(pinned, HostArenas.total(sizes))
        arenas._alloc = lambda n: None  # type: ignore[method-assign]
        for n in sizes:
            arenas.take(n)
        return arenas.bytes

    @staticmethod
    def total(sizes: Sequence[int]) -> int:
        return sum((n + ALIGN - 1) // ALIGN * ALIGN for n in sizes)

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, pin_memory=self.pinned)

    def take(self, nbytes: int) -> torch.Tensor | None:
        need = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        if need > self.arena // 2:
            size = 1 << (need - 1).bit_length() if self.pinned else need  # what the pinned allocator holds
            buf = self._alloc(need)
            self.buffers.append(buf)
            self._free.append(-1)
            self.bytes += size
            return None if buf is None else buf[:nbytes]
        for i, free in enumerate(self._free):
            if free >= need:
                break
        else:
            self.buffers.append(self._alloc(self.arena))
            self._free.append(self.arena)
            self.bytes += self.arena
            i = len(self._free) - 1
        off = self.arena - self._free[i]
        self._free[i] -= need
        buf = self.buffers[i]
        return None if buf is None else buf[off:off + nbytes]
