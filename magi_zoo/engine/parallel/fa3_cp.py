"""The engine's fa3 kernel under context parallelism: diffusers' templated Ulysses / ring around
it, served from the registry slot the fa3 kernel occupies while a sequence split is installed.

diffusers' own backends add context parallelism the same way: a forward op (and a backward op)
handed to its templated attention, which runs the all-to-alls (Ulysses) or the KV ring around
them. The fa3 kernel module is left as it is; the slot gets `fa3_context_parallel_attention`,
marked context-parallel capable, and the undo puts the registry entry back.
"""

from __future__ import annotations

from typing import Callable

from ..compat import diffusers as diffusers_compat
from ..kernels import fa3


def _fa3_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """Diffusers' context-parallel forward-op contract on the fa3 kernel (what Ulysses calls
    between its all-to-alls, and ring once per KV chunk, with return_lse=True)."""
    return fa3.fa3_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)


def _fa3_backward_op(ctx, grad_out, *args, **kwargs):
    raise RuntimeError("attention backend 'fa3' has no backward under context parallelism (its cuDNN backward "
                       "is wired for one process only); train context-parallel with backend='native'")


def fa3_context_parallel_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                   enable_gqa=False, return_lse=False, _parallel_config=None):
    """The engine's fa3 backend, plus diffusers' templated Ulysses / ring around it when the
    layer carries a context-parallel config (diffusers' own backends are written the same way).
    The parameter names are diffusers' dispatch signature (it passes `_parallel_config` by name)."""
    if _parallel_config is None:
        return fa3.fa3_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)
    return diffusers_compat.templated_context_parallel_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
        forward_op=_fa3_forward_op, backward_op=_fa3_backward_op, parallel_config=_parallel_config)


def serve_fa3_context_parallel(member) -> Callable[[], None]:
    """Serve `member` (the slot the engine's fa3 kernel occupies) with
    `fa3_context_parallel_attention`, marked context-parallel capable; returns the undo that
    puts the registry entry back."""
    saved = diffusers_compat.backend_entry(member)
    diffusers_compat.register_backend(member, fa3_context_parallel_attention,
                                      constraints=diffusers_compat.backend_constraints(member), context_parallel=True)
    return lambda: diffusers_compat.restore_backend_entry(member, saved)
