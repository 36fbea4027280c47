"""Custom-op registry: `torch.library.custom_op` + `register_fake`, in the `magi_zoo`
namespace, with the flags the engine reads.

An op registered here is opaque to dynamo: a region that calls it still compiles with
`fullgraph=True`, where `torch.compiler.disable` would have split the graph. The flags
the engine reads: `is_subgraph_boundary` marks ops where a graph may be split (e.g.
varlen attention) -- a region of the same family that captures CUDA graphs is compiled
with inductor's graph partition split there (`engine.compile.partition_at_boundaries`);
`is_compute_sensitive` marks ops whose outputs recompute saves rather than recomputes
(matmul-heavy ops; `engine.recompute`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

import torch

NAMESPACE = "magi_zoo"
_NAME_RX = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class CustomOpInfo:
    """One registered op and the flags the engine reads."""

    name: str  # qualified, e.g. "magi_zoo::varlen_attention"
    op: Callable  # the torch.library CustomOpDef (call it like the function)
    is_compute_sensitive: bool
    is_subgraph_boundary: bool

    @property
    def overload(self):
        """The `torch.ops.magi_zoo.<name>.default` overload, as it appears in FX graphs."""
        return getattr(getattr(torch.ops, NAMESPACE), self.name.split("::")[1]).default


_REGISTRY: dict[str, CustomOpInfo] = {}


def _qualify(name: str) -> str:
    if "::" in name:
        ns, short = name.split("::", 1)
        if ns != NAMESPACE:
            raise ValueError(f"custom op {name!r}: ops live in the {NAMESPACE!r} namespace; "
                             f"pass {short!r} or '{NAMESPACE}::{short}'")
        name = short
    if not _NAME_RX.match(name):
        raise ValueError(f"custom op name {name!r} must be a Python identifier (letters, digits, _)")
    return f"{NAMESPACE}::{name}"


def register_custom_op(
    name: str,
    *,
    is_compute_sensitive: bool = False,
    is_subgraph_boundary: bool = False,
    mutates_args: Iterable[str] | str = (),
    fake: Callable | None = None,
) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as the custom op ``magi_zoo::<name>``.

    The function needs type annotations (torch infers the op schema from them). `fake`
    computes output metadata (shapes, dtypes) without data, for tracing; without it, an
    op whose outputs cannot be inferred fails to compile with torch's own error. Returns
    the op, callable like the function. Registering the same name twice with the same
    function returns the existing op (module reloads); a different function is an error.
    """
    qualname = _qualify(name)

    def decorator(fn: Callable) -> Callable:
        existing = _REGISTRY.get(qualname)
        if existing is not None:
            if getattr(existing.op, "_magi_zoo_fn_qualname", None) == f"{fn.__module__}.{fn.__qualname__}":
                return existing.op
            raise ValueError(f"custom op {qualname!r} is already registered by another function")
        op = torch.library.custom_op(qualname, mutates_args=mutates_args)(fn)
        if fake is not None:
            op.register_fake(fake)
        op._magi_zoo_fn_qualname = f"{fn.__module__}.{fn.__qualname__}"
        _REGISTRY[qualname] = CustomOpInfo(qualname, op, is_compute_sensitive, is_subgraph_boundary)
        return op

    return decorator


def custom_op_info(name: str) -> CustomOpInfo:
    """The registry entry of one op; unknown names list the registered ones."""
    q = _qualify(name)
    if q not in _REGISTRY:
        raise KeyError(f"no custom op {q!r}; registered: {', '.join(sorted(_REGISTRY)) or '(none)'}")
    return _REGISTRY[q]


def list_custom_ops(*, is_subgraph_boundary: bool | None = None,
                    is_compute_sensitive: bool | None = None) -> list[CustomOpInfo]:
    """Registered ops, optionally filtered by flag."""
    out = []
    for info in _REGISTRY.values():
        if is_subgraph_boundary is not None and info.is_subgraph_boundary != is_subgraph_boundary:
            continue
        if is_compute_sensitive is not None and info.is_compute_sensitive != is_compute_sensitive:
            continue
        out.append(info)
    return out
