"""An adapter's entry point called on its example inputs, and the tensors of what it returns:
what the conformance checks compare (compiled against eager, the fp8 and h100 plans against
bf16 eager)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def tensors(out: Any, where: str = "out") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in an entry point's output, with its place: tensors, tuples and lists,
    dicts (transformers' ModelOutput is one), dataclasses. Anything else (a KV-cache
    object, None, a number) is not an output to compare."""
    if torch.is_tensor(out):
        return [(where, out)]
    if isinstance(out, dict):
        return [t for k, v in out.items() for t in tensors(v, f"{where}.{k}")]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in tensors(getattr(out, f.name), f"{where}.{f.name}")]
    if isinstance(out, (tuple, list)):
        return [t for i, v in enumerate(out) for t in tensors(v, f"{where}[{i}]")]
    return []


def call_entry(handle, entry: str, **shape) -> Any:
    """One call of an entry point on fresh example inputs (a call may consume state it is
    given, e.g. a KV cache, so identical calls get identical fresh inputs)."""
    a = handle.adapter
    module, method = a.entry(handle.pipe, entry)
    kwargs = a.example_inputs(handle.pipe, handle.variant, entry, **shape)
    with torch.no_grad():
        return getattr(module, method)(**kwargs)
