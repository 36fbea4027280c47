"""The selective policy as data: which ops a checkpointed block keeps.

`save` names op groups (`OP_GROUPS`: matmuls, attention), a shape-defined group
(``down-projections``) or op names; `save_set` turns them into op packets, `context_fn`
into the ``context_fn`` a selective `torch.utils.checkpoint.checkpoint` takes. Every custom
op registered with ``is_compute_sensitive=True`` is kept too (this module reads that flag).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ...specs.recompute_spec import OP_GROUPS, SHAPE_GROUPS, resolve_op_name
from ..custom_ops import NAMESPACE, list_custom_ops
from ..kernels import fa3 as _fa3  # noqa: F401 -- registers magi_zoo::fa3_attention, an OP_GROUPS entry
from ..kernels import gelu_linear as _gelu_linear  # noqa: F401 -- registers magi_zoo::linear_gelu_tanh, one too

DOWN = "down-projections"  # the shape-defined group (SHAPE_GROUPS)


@functools.lru_cache(maxsize=None)
def group_ops(group: str) -> frozenset:
    """The op packets of one group (`OP_GROUPS`) that exist in this torch build."""
    out = set()
    for name in OP_GROUPS[group]:
        ns, op = name.split(".")
        packet = getattr(getattr(torch.ops, ns), op, None)
        if packet is not None:
            out.add(packet)
    return frozenset(out)


def op_group(func: Any) -> str:
    """Which group an op belongs to: 'sensitive' (a compute-sensitive custom op), 'matmuls',
    'attention', or 'other'."""
    if is_compute_sensitive(func):
        return "sensitive"
    packet = getattr(func, "overloadpacket", func)
    for group in OP_GROUPS:
        if packet in group_ops(group):
            return group
    return "other"


def is_compute_sensitive(func: Any) -> bool:
    """Is `func` a custom op registered with ``is_compute_sensitive=True``? Read at trace
    time, so an op registered after `apply` still counts."""
    if getattr(func, "namespace", None) != NAMESPACE:
        return False
    return any(info.overload is func for info in list_custom_ops(is_compute_sensitive=True))


def _operand_dims(func: Any, args: tuple) -> tuple[int, int] | None:
    """(K, N) of a matmul call -- reduction dim, output dim -- or None for other ops."""
    packet = getattr(func, "overloadpacket", func)
    if packet not in group_ops("matmuls") or len(args) < 2:
        return None
    name = getattr(packet, "__name__", "")
    if name in ("linear", "linear_gelu_tanh"):  # (input, weight[N, K], bias)
        a, w = args[0], args[1]
        return (a.shape[-1], w.shape[0]) if hasattr(a, "shape") and hasattr(w, "shape") else None
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") and len(args) >= 3 else (args[0], args[1])
    if not (hasattr(a, "shape") and hasattr(b, "shape")) or a.dim() < 1 or b.dim() < 1:
        return None
    return a.shape[-1], b.shape[-1]


def is_down_projection(func: Any, args: tuple) -> bool:
    """A matmul whose reduction dim exceeds its output dim (K > N)."""
    dims = _operand_dims(func, args)
    return dims is not None and dims[0] > dims[1]


def save_set(names: Sequence[str]) -> frozenset:
    """Op packets / overloads that `save` names (groups expanded; a shape-defined group stays
    its name, the policy tests the call's shapes)."""
    out: set = set()
    for name in names:
        if name in SHAPE_GROUPS:
            out.add(name)
        else:
            out |= group_ops(name) if name in OP_GROUPS else {resolve_op_name(name)}
    return frozenset(out)


def option_name(save: tuple[str, ...] | None) -> str:
    """What a block keeps, in words: None = no checkpoint; () = full recompute."""
    return "no checkpoint" if save is None else "full" if not save else "keep " + "+".join(save)


def _policy(saved: frozenset) -> Callable:
    # A closure per save set (what dynamo's checkpoint support accepts as a policy): keep
    # the named ops' outputs and the compute-sensitive custom ops', recompute the rest.
    down = DOWN in saved

    def policy(ctx, func, *args, **kwargs):
        if func in saved or getattr(func, "overloadpacket", None) in saved or is_compute_sensitive(func):
            return CheckpointPolicy.MUST_SAVE
        if down and is_down_projection(func, args):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@functools.lru_cache(maxsize=None)
def context_fn(saved: frozenset) -> Callable:
    """The `context_fn` of a selective checkpoint keeping `saved`: one object per save set,
    so blocks with the same choice share one compiled graph (dynamo guards on its identity)."""
    return functools.partial(create_selective_checkpoint_contexts, _policy(saved))
