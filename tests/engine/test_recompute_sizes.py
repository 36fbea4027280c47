"""`auto` recompute measures sizes, not allocator readings: the same tiny Wan calibrated in a
clean state and again with a large allocation held and the heap fragmented gets the same
bytes per option, the same working sets and the same choice; the estimated peak of the
step it chose is within 10% of the step's measured peak (`LiveBytes`). On CUDA the same
calibration under a hard cap (`set_per_process_memory_fraction`) and uncapped agree.

Timings are noise at this size, so the CPU tests run the measurement on a clock that
counts aten ops (1 ms each): the choice then depends on the sizes alone."""

from __future__ import annotations

import types

import pytest
import torch

import magi_zoo
from magi_zoo.engine.compat.torch import TorchDispatchMode
from magi_zoo.engine.recompute import calibrate, measure
from magi_zoo.train import flow_matching_loss

# 96 x 96 x 13 frames: 144 tokens, so a block's activations (0.46 MiB without checkpoint)
# outweigh the tiny model's weights (0.44 MiB, all components) in the step
SHAPE = dict(height=96, width=96, frames=13)
# between full recompute everywhere (~1.4 MiB: weights, 4 x a block's gradient 0.06, one
# block's recompute working set 0.69) and no checkpoint everywhere (~2.6 MiB): a mixed choice
BUDGET_GIB = 2.3 / 1024


class _OpClock(TorchDispatchMode):
    """perf_counter for the measurement: 1 ms per aten op dispatched."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _load(device: str = "cpu", dtype: str | None = None, budget: float = BUDGET_GIB):
    kw = {"dtype": dtype} if dtype else {}
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu" if device == "cpu" else "auto", device=device, train=True,
                      recompute={"policy": "auto", "train_peak_gib": budget, "optimizer_states": 0},
                      calibrate=False, compile={"WanTransformerBlock": {"enabled": False}}, **kw)
    module, _ = h.adapter.entry(h.pipe, h.adapter.entry_points[0])
    inputs = h.adapter.example_inputs(h.pipe, h.variant, "denoise", **SHAPE)
    return h, module, inputs


def _sizes(result: list[dict]) -> dict:
    (r,) = result
    return {"choice": r["choice"], "peak": r["estimated_peak_bytes"],
            "options": [(o["name"], o["bytes_per_block"], o["backward_working_set_bytes"]) for o in r["options"]]}


def _calibrate_on_op_clock(h, module, inputs, monkeypatch) -> list[dict]:
    clock = _OpClock()
    monkeypatch.setattr(measure, "time", types.SimpleNamespace(perf_counter=lambda: clock.ops * 1e-3))
    with clock:
        return calibrate(h.modules, lambda: module(**inputs))


@pytest.fixture(scope="module")
def tiny():
    return _load()


def test_calibration_does_not_depend_on_the_allocators_state_and_estimates_the_peak(tiny, monkeypatch):
    h, module, inputs = tiny
    result = _calibrate_on_op_clock(h, module, inputs, monkeypatch)
    clean = _sizes(result)
    # the budget gives a mixed choice (a size that moved would move it)
    assert len(clean["choice"]) > 1, clean["choice"]
    # A large allocation held, and the heap full of holes of the block's own tensor sizes:
    # freed outputs now land elsewhere than before, which an address-keyed count would see
    big = torch.empty(64 * 2 ** 20, dtype=torch.uint8)
    sizes = [n for _, n, _ in clean["options"]] + [144 * 32 * 4, 144 * 64 * 4, 144 * 128 * 4]
    held = [torch.empty(sizes[i % len(sizes)] // 4 + i % 7) for i in range(3000)]
    del held[::2]
    fragmented = _sizes(_calibrate_on_op_clock(h, module, inputs, monkeypatch))
    del big, held
    assert fragmented == clean

    # The step as chosen, measured: what was alive before it (every component's weights;
    # the inputs are not the model's) plus the most its tensors held at once. optimizer_states=0:
    # the step is forward + backward.
    gen = torch.Generator().manual_seed(0)

    def step():
        flow_matching_loss(h.trainable, inputs, generator=gen).backward()

    _, made = measure.measure_peak(step)
    h.trainable.zero_grad(set_to_none=True)
    before = sum(t.numel() * t.element_size() for t in [*h.modules.parameters(), *h.modules.buffers()])
    measured, estimated = before + made, result[0]["estimated_peak_bytes"]
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_live_bytes_counts_what_is_alive_not_addresses():
    x = torch.randn(256, 256, requires_grad=True)
    live = measure.LiveBytes()
    with live:
        y = (x @ x).relu()  # mm's output freed after relu; relu's kept (saved for backward)
        z = y.sum()
        assert live.current == 256 * 256 * 4 + 4  # relu's output and the scalar
        z.backward()
    del y, z
    assert live.current == 256 * 256 * 4  # x.grad
    # in the backward: relu's output, its gradient, and x's two gradients (x is both operands
    # of the mm) before they are summed into x.grad
    assert 3 * 256 * 256 * 4 <= live.peak <= 4 * 256 * 256 * 4 + 64


@pytest.mark.gpu
def test_calibration_under_a_hard_cap_equals_uncapped(monkeypatch):
    """CUDA: the same calibration uncapped, then under a hard cap (the process limited to
    what it has reserved plus 256 MiB) with the allocator's cache full of freed blocks of
    odd sizes (freed: what is live counts in the budget, what is cached must not):
    the same bytes per option (exactly), working sets within the allocator's rounding (a
    block it does not split is allocated whole: < 1 MiB more per live block), the same
    choice."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    h, module, inputs = _load("cuda", "bfloat16")
    uncapped = _sizes(_calibrate_on_op_clock(h, module, inputs, monkeypatch))
    junk = [torch.empty(int(2 ** 20 * (1 + i % 5) * 1.3) + 512 * (i % 3), dtype=torch.uint8, device="cuda")
            for i in range(200)]
    small = [torch.empty(1000 + 37 * i, dtype=torch.uint8, device="cuda") for i in range(500)]
    del junk, small
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 256 * 2 ** 20) / total)
    try:
        capped = _sizes(_calibrate_on_op_clock(h, module, inputs, monkeypatch))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert [o[:2] for o in capped["options"]] == [o[:2] for o in uncapped["options"]]
    for a, b in zip(uncapped["options"], capped["options"]):
        assert abs(a[2] - b[2]) <= 2 ** 21, (a, b)
    assert capped["choice"] == uncapped["choice"]
