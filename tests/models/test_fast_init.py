"""Parallel random fills for host builds (magi_zoo/adapters/fast_init.py)."""

import math

import pytest
import torch

from magi_zoo.adapters.fast_init import MIN_NUMEL, parallel_fills


def _kaiming(seed: int, workers: int) -> torch.Tensor:
    torch.manual_seed(seed)
    w = torch.empty(4096, 2048)
    with parallel_fills(workers):
        torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # nn.Linear's init
    return w


def test_fills_are_reproducible_and_keep_their_distribution():
    a, b, c = _kaiming(0, 4), _kaiming(0, 4), _kaiming(1, 4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    bound = 1 / math.sqrt(2048)  # kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert a.abs().max() <= bound and abs(a.std().item() - bound / math.sqrt(3)) < 0.01 * bound
    # The pieces come from different generators: no two pieces repeat each other.
    flat = a.view(-1)
    n = flat.numel() // 4
    assert not torch.equal(flat[:n], flat[n:2 * n])
    torch.manual_seed(0)
    with parallel_fills(4):
        x = torch.empty(MIN_NUMEL).normal_(3.0, 2.0)
    assert abs(x.mean().item() - 3.0) < 0.01 and abs(x.std().item() - 2.0) < 0.01


def test_small_fills_and_explicit_generators_are_untouched():
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    with parallel_fills(4):
        a = torch.empty(MIN_NUMEL * 2).uniform_(generator=g1)
        torch.manual_seed(3)
        s = torch.empty(1000).normal_()
    b = torch.empty(MIN_NUMEL * 2).uniform_(generator=g2)
    torch.manual_seed(3)
    assert torch.equal(a, b) and torch.equal(s, torch.empty(1000).normal_())


def test_parameters_that_require_grad_fill_in_place():
    # Modules' init fills Parameters (requires_grad) under no_grad; the pieces are filled
    # from worker threads, which must not trip autograd's in-place checks.
    torch.manual_seed(0)
    with parallel_fills(4):
        lin = torch.nn.Linear(4096, 1024)
    assert lin.weight.requires_grad and lin.weight.abs().max() > 0
    assert abs(lin.weight.std().item() - 1 / math.sqrt(4096) / math.sqrt(3)) < 1e-3


def _drawn_via(via, seed: int, numel: int) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.empty(numel, dtype=torch.bfloat16)
    with parallel_fills(2, via=via):
        x.uniform_(-2.0, 2.0)
    return x


def test_fills_drawn_on_a_device_in_bounded_pieces(monkeypatch):
    # `via`: each piece is drawn on that device (a card, on GPU machines) and copied into the
    # host tensor, in pieces of at most MAX_PIECE values. The CPU stands in for the card here.
    import magi_zoo.adapters.fast_init as fi

    monkeypatch.setattr(fi, "MAX_PIECE", MIN_NUMEL // 2)
    seen = []
    real_empty = torch.empty

    def spy(*a, **k):
        t = real_empty(*a, **k)
        if k.get("device") is not None:
            seen.append(t.numel())
        return t

    monkeypatch.setattr(torch, "empty", spy)
    a = _drawn_via("cpu", 0, MIN_NUMEL * 3)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert seen and max(seen) <= MIN_NUMEL // 2 and sum(seen) == MIN_NUMEL * 3
    b, c = _drawn_via("cpu", 0, MIN_NUMEL * 3), _drawn_via("cpu", 1, MIN_NUMEL * 3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    f = a.float()
    assert f.min() >= -2.0 and f.max() <= 2.0 and abs(f.mean().item()) < 0.01
    assert abs(f.std().item() - 4 / math.sqrt(12)) < 0.01


@pytest.mark.gpu
def test_fills_drawn_on_the_card():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    with parallel_fills(4, via="cuda"):
        lin = torch.nn.Linear(4096, 4096)
    assert lin.weight.device.type == "cpu"
    assert abs(lin.weight.std().item() - 1 / math.sqrt(4096) / math.sqrt(3)) < 1e-3
    assert torch.equal(_drawn_via("cuda", 3, MIN_NUMEL * 2), _drawn_via("cuda", 3, MIN_NUMEL * 2))
