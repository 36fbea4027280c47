"""LightX2V's step- and CFG-distilled Wan (magi_zoo/adapters/wan/distill.py): the published
variants' sampler and call defaults (meta device), the sampler against LightX2V's own step
rule, the distilled DiT read from distill_models/ of an original-layout directory, and the
Wan2.2 distill LoRA pair routed into the two experts."""

import copy
import dataclasses

import pytest
import torch
from helpers.lora_files import original_wan_lora
from helpers.wan_original_layout import dit_back
from safetensors.torch import save_file

import magi_zoo
from magi_zoo.adapters import lookup
from magi_zoo.adapters.wan import distill, original
from magi_zoo.adapters.wan.config import TINY

DISTILLED = ["wan2.1-i2v-14b-480p-distill", "wan2.1-t2v-14b-distill", "wan2.1-i2v-14b-480p-distill-lora",
             "wan2.1-t2v-14b-distill-lora", "wan2.2-t2v-a14b-distill-lora"]


def test_published_variants_sample_as_lightx2v():
    for name in DISTILLED:
        adapter, v = lookup(name)
        d = adapter.call_defaults(v)
        # LightX2V's configs: 4 steps, enable_cfg false (guidance 1: one forward per step), 480x832x81
        assert (d["num_inference_steps"], d["guidance_scale"], d["height"], d["width"], d["num_frames"]) == \
            (4, 1.0, 480, 832, 81), name
        assert v.config["distill"] == {"shift": 5.0, "denoising_step_list": (1000, 750, 500, 250)}
    assert lookup("wan2.2-t2v-a14b-distill-lora")[1].call_defaults["guidance_scale_2"] == 1.0
    assert [x["component"] for x in lookup("wan2.2-t2v-a14b-distill-lora")[1].config["lora"]] == \
        ["transformer", "transformer_2"]
    # (tests/conformance builds every one at its published size on the meta device)
    s = distill.make_scheduler(lookup("wan2.1-i2v-14b-480p-distill")[1].config["distill"])
    s.set_timesteps(4)
    # LightX2V's WanStepDistillScheduler at [1000, 750, 500, 250], shift 5: 1, 0.9375, 0.8333, 0.625
    torch.testing.assert_close(s.sigmas, torch.tensor(distill.lightx2v_sigmas() + [0.0]))
    torch.testing.assert_close(s.timesteps, torch.tensor(distill.lightx2v_sigmas()) * 1000)


def test_sampler_step_is_lightx2v_step_post():
    """Each step x - sigma * v + sigma_next * v (LightX2V's step_post), through diffusers' step."""
    s = distill.make_scheduler(distill.CONFIG)
    s.set_timesteps(4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 2, 4, 4, generator=g)
    ref = x.clone()
    sig = distill.lightx2v_sigmas() + [0.0]
    for i, t in enumerate(s.timesteps):
        v = torch.randn(x.shape, generator=g)
        x = s.step(v, t, x, return_dict=False)[0]
        ref = ref - sig[i] * v + sig[i + 1] * v
    torch.testing.assert_close(x, ref)


@pytest.fixture(scope="module")
def tiny_distill():
    """wan2.1-tiny with the distilled sampler and call defaults (the -distill variants' config)."""
    adapter, v = lookup("wan2.1-tiny")
    return adapter, dataclasses.replace(v, config=dict(TINY, distill=distill.CONFIG),
                                        call_defaults={**v.call_defaults, **distill.CALL})


def test_distilled_call_is_four_forwards_without_cfg(tiny_distill, tmp_path):
    adapter, v = tiny_distill
    pipe = adapter.build(v, weights="random", dtype=torch.float32, device=torch.device("cpu"))
    calls = []
    pipe.transformer.register_forward_hook(lambda m, a, kw: calls.append(1))
    pipe(prompt="a corgi", output_type="latent", **adapter.call_defaults(v))
    assert len(calls) == 4  # 4 steps, guidance 1: no unconditional forward
    adapter.save_pretrained(pipe, tmp_path / "saved")  # the sampler saved as the library class it extends
    assert '"FlowMatchEulerDiscreteScheduler"' in (tmp_path / "saved" / "model_index.json").read_text()
    back = adapter.build(v, weights=str(tmp_path / "saved"), dtype=torch.float32, device=torch.device("cpu"))
    assert type(back.scheduler) is distill.scheduler_class() and back.scheduler.config.shift == 5.0


def test_distilled_dit_is_read_from_distill_models(tiny_distill, tmp_path):
    """LightX2V's layout: the distilled DiT in distill_models/distill_model.safetensors, original names."""
    adapter, v = tiny_distill
    pipe = adapter.build(v, weights="random", dtype=torch.float32, device=torch.device("cpu"))
    sd = {dit_back(k): t.contiguous() for k, t in pipe.transformer.state_dict().items()}
    (tmp_path / "distill_models").mkdir()
    save_file(sd, str(tmp_path / "distill_models" / "distill_model.safetensors"))
    cfg = dict(dim=32, ffn_dim=64, freq_dim=32, num_heads=2, num_layers=4, in_dim=16, out_dim=16, text_len=512,
               eps=1e-6, model_type="t2v")
    (tmp_path / "config.json").write_text(__import__("json").dumps(cfg))
    assert original.detect_layout(tmp_path) == "original"  # no base DiT beside it: still the original layout
    dit = original.load_transformer(tmp_path, dtype=torch.float32, distill=True)
    for k, t in pipe.transformer.state_dict().items():
        assert torch.equal(dit.state_dict()[k], t), k
    with pytest.raises(ValueError, match="no distill_models/distill_model.safetensors or .pt"):
        original.load_transformer(tmp_path / "distill_models", dtype=torch.float32, distill=True)


def test_distill_lora_variant_merges_its_published_loras(monkeypatch):
    seen = []

    def stop(adapter, variant, specs, dtype):
        seen.append([(s.source, s.component) for s in specs])
        raise RuntimeError("stop before the build")

    monkeypatch.setattr(magi_zoo.zoo.lora_loader, "check_for", stop)
    with pytest.raises(RuntimeError, match="stop before the build"):
        magi_zoo.load("wan2.2-t2v-a14b-distill-lora", gpu="cpu", weights="random")
    assert seen[-1] == [(x["source"], x["component"]) for x in distill.LORA_22_T2V]
    with pytest.raises(RuntimeError, match="stop before the build"):
        magi_zoo.load("wan2.1-i2v-14b-480p-distill-lora", gpu="cpu", weights="random", lora=["mine.safetensors"])
    assert seen[-1] == [("mine.safetensors", "transformer")]  # lora= replaces the variant's own


def test_wan22_distill_lora_pair_goes_into_each_expert(tmp_path):
    pytest.importorskip("peft")
    hi = original_wan_lora(tmp_path / "high_noise.safetensors", seed=10)
    lo = original_wan_lora(tmp_path / "low_noise.safetensors", seed=11)
    base = magi_zoo.load("wan2.2-tiny", gpu="cpu", compile=False)
    fused = magi_zoo.load("wan2.2-tiny", gpu="cpu", compile=False,
                          lora=[{"source": hi}, {"source": lo, "component": "transformer_2"}])
    ref = copy.deepcopy(base.pipe)
    ref.load_lora_weights(str(hi), adapter_name="hi")
    ref.load_lora_weights(str(lo), adapter_name="lo", load_into_transformer_2=True)
    kw = base.adapter.denoiser_inputs(base.pipe, base.variant)
    with torch.inference_mode():
        for name in ("transformer", "transformer_2"):
            out = getattr(fused.pipe, name)(**kw)[0]
            torch.testing.assert_close(out, getattr(ref, name)(**kw)[0], rtol=1e-4, atol=1e-5)
            assert (out - getattr(base.pipe, name)(**kw)[0]).abs().max() > 1e-3
    assert "into transformer_2" in fused.lora.lines()[1]
