"""LoRA and fp8 checkpoints on a card, Wan2.1-T2V-1.3B at its published size (random weights):
a fused LoRA compiles and runs as the base model does (counters; forward time within a few %),
a hot-swapped LoRA on the inductor-compiled model recompiles nothing, and an fp8 checkpoint
loads to the same forward as quantize-at-load with half the host bytes of its block linears.

    python -m pytest -q -m gpu tests/gpu/test_lora_gpu.py
"""

import pytest
import torch
from helpers.lora_files import diffusers_lora

import magi_zoo
from benchmarks.common import time_calls

pytestmark = pytest.mark.gpu

MODEL = "wan2.1-t2v-1.3b"
SHAPE = dict(height=480, width=832, frames=81)


def _time_ms(fn, runs=10):
    """Median ms of `runs` calls after 3 warm-up calls (CUDA events: the harness's timing)."""
    return time_calls(fn, torch.device("cuda"), warmup=3, runs=runs)["median_ms"]


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    pytest.importorskip("peft")
    d = tmp_path_factory.mktemp("gpu_loras")
    # rank 64 on every attention projection of the 30 blocks (width 1536), as LightX2V's LoRAs
    return (diffusers_lora(d / "a.safetensors", dim=1536, blocks=30, rank=64, attn=("attn1", "attn2")),
            diffusers_lora(d / "b.safetensors", dim=1536, blocks=30, rank=64, seed=9, attn=("attn1", "attn2")))


@pytest.mark.gpu_timing
def test_fused_lora_runs_as_the_base_model(lora_files):
    torch.compiler.reset()
    base = magi_zoo.load(MODEL, gpu="auto", weights="random")
    kw = base.adapter.denoiser_inputs(base.pipe, base.variant, **SHAPE)
    with torch.inference_mode():
        t_base = _time_ms(lambda: base.pipe.transformer(**kw))
    frames_base = base.report().frames
    del base
    torch.compiler.reset()
    fused = magi_zoo.load(MODEL, gpu="auto", weights="random", lora=[lora_files[0]])
    with torch.inference_mode():
        t_fused = _time_ms(lambda: fused.pipe.transformer(**kw))
    r = fused.report()
    assert (r.frames, r.recompiles) == (frames_base, 0)
    print(f"\nforward ms: base {t_base:.1f}, fused LoRA {t_fused:.1f} ({t_fused / t_base - 1:+.2%})")
    assert t_fused <= 1.03 * t_base  # the same graphs on the same shapes (the goal: within 1%)


def test_hotswap_on_inductor_recompiles_nothing(lora_files):
    torch.compiler.reset()
    h = magi_zoo.load(MODEL, gpu="auto", weights="random", lora=[lora_files[0]], lora_hotswap=64)
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant, **SHAPE)
    with torch.inference_mode():
        a = h.pipe.transformer(**kw)[0]
        frames = h.report().frames
        h.swap_lora(lora_files[1], scale=0.8)
        b = h.pipe.transformer(**kw)[0]
    r = h.report()
    assert (r.frames, r.recompiles) == (frames, 0)
    assert (a - b).abs().max() > 0  # the swap took effect


def test_fp8_checkpoint_round_trip(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 matmuls need compute capability >= 8.9")
    bf16 = magi_zoo.load(MODEL, gpu="auto", weights="random", compile=False)
    bf16.save_pretrained(tmp_path / "fp8", precision="fp8")
    quant = magi_zoo.load(MODEL, gpu="auto", weights="random", precision="fp8")
    back = magi_zoo.load(MODEL, gpu="auto", weights=str(tmp_path / "fp8"))  # precision="fp8" by itself on fp8 cards
    assert "already fp8" in back.report().step("precision").did
    kw = quant.adapter.denoiser_inputs(quant.pipe, quant.variant, **SHAPE)
    with torch.inference_mode():
        torch.testing.assert_close(back.pipe.transformer(**kw)[0], quant.pipe.transformer(**kw)[0], rtol=0, atol=0)
