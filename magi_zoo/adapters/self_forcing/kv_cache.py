"""The static KV cache: preallocated once for the whole video, written at offsets the host
computes from the block index.

Per layer one key and one value tensor (B, heads, N, D), N = every token of the video
(32,760 at 480x832 x 81 frames: 30 layers x 2 x 32,760 x 12 x 128 x 2 bytes = 6.0 GB in
bf16), in the layout attention reads (heads before tokens). The schedule is fixed, so
every offset is known before the first block runs: per block the S slots it writes
(block_start .. block_start + S; a ring after the sinks with a rolling cache) and the
length it attends to are made into device tensors once, and each step is handed the same-shaped tensors -- nothing is read
back, and no shape depends on the block.
"""

from __future__ import annotations

import torch

from ...engine.compat.torch import mark_static_address
from .config import BlockSchedule


class StaticKVCache:
    """Keys/values of every layer for one video shape, plus each block's write positions
    and attended length as device tensors."""

    def __init__(self, num_layers: int, batch: int, heads: int, head_dim: int, schedule: BlockSchedule, *,
                 dtype: torch.dtype, device: torch.device | str):
        n = schedule.cache_tokens
        self.schedule = schedule
        self.shape = (batch, heads, n, head_dim)
        self.k = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for t in self.k + self.v:  # written in place by the compiled step: CUDA graphs need fixed addresses
            mark_static_address(t)
        self.write_index = [torch.tensor(schedule.write_slots(b), dtype=torch.long, device=device)
                            for b in range(schedule.num_blocks)]
        self.kv_len = [torch.tensor(schedule.attend_len(b), dtype=torch.long, device=device)
                       for b in range(schedule.num_blocks)]

    def matches(self, num_layers: int, batch: int, heads: int, head_dim: int, schedule: BlockSchedule,
                dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this cache serves a video of that shape (then it is reused: same tensors,
        same addresses -- what CUDA graphs need)."""
        k = self.k[0]
        return (len(self.k), self.shape, self.schedule, k.dtype, k.device) == (
            num_layers, (batch, heads, schedule.cache_tokens, head_dim), schedule, dtype, torch.device(device))

    def step_args(self, block: int) -> dict:
        """The cache arguments of `denoise_step` for `block`."""
        return dict(cache_k=self.k, cache_v=self.v, write_index=self.write_index[block], kv_len=self.kv_len[block])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
