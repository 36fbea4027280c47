"""The ``fa3_varlen`` attention backend: FlashAttention-3's forward for calls whose boolean mask
only pads keys, behind diffusers' ``_FLASH_VARLEN_3`` dispatch slot.

Why it exists: a model that pads its prompt masks the padded keys in every attention call, and
FA3's forward takes no mask, so on ``fa3`` every such call runs on SDPA (`kernels/fa3.py`).
HunyuanVideo-1.5 masks all of its joint attentions (an L x L boolean mask, L = 51,275 at
480x848x121), so ``fa3`` never reaches its kernel there. FA3 does take ``seqused_k``: per batch
element, how many leading keys are used. A padding mask is exactly that, once the valid keys
lead.

The contract is diffusers' own for its FlashAttention varlen backends (``flash_varlen``,
``_flash_varlen_3``): the mask is boolean, of any shape those backends accept ((Lk), (B, Lk),
(B, Lq, Lk), (B, H, Lq, Lk), size-1 dimensions broadcast), and is read as *which keys are
valid*: a key is valid when any query of any head may see it, and every query then sees exactly
the valid keys. A mask that is not of that form (causal, windowed, per-query masks) does not
fit it, which is why this is a backend a spec names for a model whose masks are padding
(HunyuanVideo-1.5's: `specs/hunyuan_video15.toml`), never something ``fa3`` or ``auto`` does by
itself. Rows of queries that the mask hides from every key (a padded prompt position in an
L x L mask) are not defined by the contract; here they attend the valid keys like any other.
Such a position is hidden as a key in every call, so no valid token ever reads it. A square
mask's valid keys are read from its diagonal (`key_padding`: a padded position is hidden as a key,
a valid one may see itself), where diffusers' function reduces the whole mask: the two agree on
every padding mask; a mask that hides a valid key's own query from it is not one.

How, with no host sync and static shapes (one graph under ``fullgraph=True``): the valid keys
are moved to the front by a stable sort of the key mask (a gather of K and V: for a mask whose
valid keys already lead, HunyuanVideo's after its prompt reordering, an identity permutation
costing one copy of K and V, ~0.1 ms a layer at 480p against ~30 ms of attention), and their
count per batch element is ``seqused_k``. diffusers' own varlen function instead packs the
valid keys and reads the longest length back to the host (``.item()``), which breaks a
full-graph compile; it also assumes the valid keys lead.

What runs elsewhere: a call with no mask is `fa3.fa3_attention` (the same kernel); a float
(additive) mask, dropout, a causal flag together with a mask, or a call that needs gradients
(the trainable FA3 path has no ``seqused_k``) run on torch's SDPA (`fa3.sdpa_bshd`), as ``fa3``
does for masked calls: a bias as given, a boolean mask as the contract reads it. Context parallelism and the LSE of a
masked call are refused with what to use instead.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat import diffusers as diffusers_compat
from . import fa3

NAME = "fa3_varlen"


def key_padding(attn_mask: torch.Tensor, batch: int, seq_len_k: int) -> torch.Tensor:
    """The (batch, seq_len_k) boolean mask of valid keys that a padding mask of any shape
    diffusers' varlen backends accept means: a key is valid when a query of any head may see it
    (diffusers' reading, `_normalize_attn_mask`, exact under the contract in the module docstring).
    Raises ValueError on another shape.

    A square (Lq = Lk) mask is read from its diagonal, not reduced over its queries: a padding
    mask hides a position as a key exactly where it pads it, and a query position it pads either
    sees the valid keys or nothing, so position i may see itself exactly when key i is valid. Why:
    HunyuanVideo-1.5's processor builds its mask as m & m^T at L = 51,275 tokens, and reducing
    that over the query axis is 2.6 G elements a block -- 4.5 ms of its ~43 ms (H200,
    benchmarks/results/profiles/profile_hunyuanvideo-1.5-480p-t2v_bf16_h200.md); the diagonal is
    L. (Reading the row of the first position that sees itself would also take masks that hide a
    valid key's own query, but torch 2.11's inductor fails to generate that argmax + gather inside a
    block's graph.) Non-square masks (a cross-attention's) are reduced: Lq x Lk with few keys."""
    m = attn_mask
    if m.ndim == 1:
        m = m[None]
    elif m.ndim == 3:
        m = _any_query(m[:, None]).any(dim=1)
    elif m.ndim == 4:
        m = _any_query(m).any(dim=1)
    elif m.ndim != 2:
        raise ValueError(f"attention backend {NAME!r}: a mask of {m.ndim} dimensions is not a key-padding "
                         "mask ((Lk), (B, Lk), (B, Lq, Lk) or (B, H, Lq, Lk)); use backend='native' here")
    if m.shape[-1] != seq_len_k or m.shape[0] not in (1, batch):
        raise ValueError(f"attention backend {NAME!r}: mask of shape {tuple(attn_mask.shape)} does not match "
                         f"{batch} sequence(s) of {seq_len_k} keys")
    return m.expand(batch, seq_len_k)


def _any_query(mask: torch.Tensor) -> torch.Tensor:
    """(B, H, Lk): the keys some query of each head may see, for a (B, H, Lq, Lk) padding mask
    (key_padding's docstring says why a square one is read from its diagonal: a view, no reduction)."""
    if mask.shape[2] != mask.shape[3] or mask.shape[2] == 1:
        return mask.any(dim=2)
    return mask.diagonal(dim1=2, dim2=3)


def valid_keys_first(key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key, value) with each batch element's valid keys moved to the front in their order, and
    the count of valid keys per batch element (int32): FA3's ``seqused_k``. Key and value are
    (B, Lk, H, D); `valid` is (B, Lk) bool."""
    # A stable sort on "is padding" keeps the valid keys in their order: softmax does not care,
    # but the kernel then sums in the order it would over the trimmed sequence.
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    index = order[:, :, None, None]
    key = key.gather(1, index.expand_as(key))
    value = value.gather(1, index.expand(*index.shape[:2], *value.shape[2:]))
    return key, value, valid.sum(dim=1, dtype=torch.int32)


def fa3_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
) -> torch.Tensor:
    """Diffusers' dispatch signature (q, k, v as (batch, seq, heads, head_dim)) on FA3, a
    boolean key-padding mask taken as ``seqused_k`` (the module docstring says which calls run
    on SDPA instead)."""
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if attn_mask is None:
        return fa3.fa3_attention(query, key, value, None, dropout_p, is_causal, scale, enable_gqa, return_lse,
                                 _parallel_config)
    fa3.refuse_context_parallel(NAME, _parallel_config)
    if attn_mask.dtype != torch.bool:  # a bias may be anything (ALiBi, ...): SDPA with it, as fa3 runs it
        return fa3.fa3_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                 return_lse)
    valid = key_padding(attn_mask, query.shape[0], key.shape[1])
    if dropout_p or is_causal or needs_grad:  # SDPA, with the mask read as the contract reads it
        return fa3.fa3_attention(query, key, value, valid[:, None, None, :], dropout_p, is_causal, scale,
                                 enable_gqa, return_lse)
    fa3.require_bf16(NAME, query, key, value)
    key, value, used = valid_keys_first(key, value, valid)
    return fa3.run_forward(query, key, value, scale, False, return_lse, seqused_k=used)


# -- the backend interface the attention step reads (engine/attention/backends.py) ----------------

def missing_reason() -> str | None:
    """None when fa3_varlen can run here, else why not and what to install: it calls the fa3-fwd
    wheel's op (``seqused_k``), so the wheel must load even where the official package is present."""
    return fa3.wheel_missing_reason()


def register():
    """Make diffusers' ``_FLASH_VARLEN_3`` dispatch to `fa3_varlen_attention` and return that member.
    Idempotent. The slot is taken only where diffusers' own entry cannot run (its
    ``flash_attn_interface`` package is absent), so a working library backend is never replaced;
    where it can, that entry serves (the same kernel, diffusers' packing). Raises RuntimeError
    naming the extra when the kernel is missing."""
    return fa3.take_slot(diffusers_compat.fa3_varlen_member(), fa3_varlen_attention)


def describe() -> str:
    """Which implementation the ``_flash_varlen_3`` slot dispatches to (for the report)."""
    if fa3.official_fa3():
        return "flash_attn_interface, diffusers' own _flash_varlen_3"
    return (f"{fa3.MODULE} in diffusers' _flash_varlen_3 slot: a boolean mask read as key padding "
            "(seqused_k); float masks, dropout and gradients on SDPA")
