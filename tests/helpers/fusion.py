"""Helpers shared by the kernel-fusion tests (test_gelu_epilogue.py, test_norm_rope.py): the
denoiser forward on a tiny model's example inputs, a call counter on a module-level op, and the
check that `remove` undid a fusion exactly."""

from __future__ import annotations

import torch

from magi_zoo.engine import remove


def forward(h):
    """The denoiser's output on the family's example inputs (inference mode)."""
    kw = h.adapter.example_inputs(h.pipe, h.variant, h.adapter.entry_points[0])
    with torch.inference_mode():
        return h.pipe.transformer(**kw)[0]


def count_calls(monkeypatch, module, name: str) -> list:
    """Replace `module.name` by a wrapper that records each call's first argument's shape."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(tuple(a[0].shape)) or real(*a))
    return calls


def assert_undone_exactly(h, ref, calls: list, leftovers) -> None:
    """`remove` the plan; `leftovers()` must then be empty, the op never called again, and the
    forward equal to `ref` bit for bit."""
    remove(h.modules)
    assert not leftovers(), leftovers()
    calls.clear()
    torch.testing.assert_close(forward(h), ref, rtol=0, atol=0)
    assert calls == []
