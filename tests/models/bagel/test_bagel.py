"""BAGEL (native adapter) on CPU: tiny variant, offline. Counters are the oracle."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import magi_zoo
from magi_zoo.engine import counters
from magi_zoo.specs import with_backend
from magi_zoo.overrides import spec_layers

EAGER = {"backend": "eager"}
ALL_EAGER = "every region on the eager backend"  # see _apply: counters and numerics, no C++ build


@pytest.fixture(scope="module")
def tiny():
    """The tiny model, built once, eager (compile=False); tests apply plans themselves."""
    return magi_zoo.load("bagel-tiny", gpu="cpu", compile=False)


@pytest.fixture(autouse=True)
def _clean(tiny):
    yield
    magi_zoo.engine.remove(tiny.modules)  # every test starts from the eager model


def _apply(handle, override):
    torch.compiler.reset()
    counters.reset()
    if override is ALL_EAGER:
        layers = with_backend(spec_layers(handle.adapter, handle.profile), "eager")
    else:
        layers = spec_layers(handle.adapter, handle.profile, compile=override)
    return magi_zoo.apply(handle.modules, layers=layers, gpu=handle.profile)


def _image(w=70, h=50, seed=0):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


# -- config / published sizes -------------------------------------------------------------------
def test_published_config_sizes_on_meta():
    """The 7B variant at its published sizes (built on the meta device: no memory)."""
    from magi_zoo.adapters.bagel.adapter import VARIANTS, build_modules

    v = VARIANTS["bagel-7b-mot"]
    model, vae = build_modules(v.config, torch.bfloat16, torch.device("meta"))
    sd = model.state_dict()
    shapes = {k: tuple(t.shape) for k, t in sd.items()}
    L = "language_model.model.layers"
    assert shapes[f"{L}.0.self_attn.q_proj_moe_gen.weight"] == (3584, 3584)
    assert shapes[f"{L}.27.self_attn.k_proj.weight"] == (512, 3584)  # 4 kv heads x 128
    assert shapes[f"{L}.27.self_attn.k_norm_moe_gen.weight"] == (128,)
    assert shapes[f"{L}.3.mlp_moe_gen.down_proj.weight"] == (3584, 18944)
    assert shapes["language_model.lm_head.weight"] == (152064, 3584)
    assert shapes["vit_model.vision_model.embeddings.patch_embedding.weight"] == (1152, 588)  # 14*14*3
    assert shapes["vit_model.vision_model.embeddings.position_embedding.weight"] == (4900, 1152)  # 70^2
    assert shapes["latent_pos_embed.pos_embed"] == (4096, 3584)  # 64^2 latent positions
    assert shapes["vae2llm.weight"] == (3584, 64)  # 2*2 patch x 16 channels
    assert f"{L}.28.input_layernorm.weight" not in shapes
    assert "vit_model.vision_model.encoder.layers.25.mlp.fc2.weight" in shapes
    assert "vit_model.vision_model.encoder.layers.26.mlp.fc2.weight" not in shapes  # 27 - 1 layers used
    # 28 layers x 2 experts x 14 tensors + 4 LLM globals = 788; ViT 26 x 16 + 5 = 421; glue 14.
    assert len(sd) == 788 + 421 + 14
    assert 14.5e9 < sum(t.numel() for t in sd.values()) < 14.7e9  # "14B total, 7B active"
    assert vae.config.latent_channels == 16 and not vae.config.use_quant_conv


def test_registry_aliases_and_bad_weights():
    from magi_zoo.adapters import lookup

    assert lookup("bagel")[1].name == "bagel-7b-mot"
    with pytest.raises(ValueError, match="tiny random variant"):
        magi_zoo.load("bagel-tiny", gpu="cpu", weights="some/hub-id", compile=False)


# -- pure functions ---------------------------------------------------------------------------------
def test_flow_schedule_and_cfg_formula():
    from magi_zoo.adapters.bagel.flow import cfg_active, cfg_combine, flow_timesteps

    ts = flow_timesteps(5, 3.0)
    # shift 3: t' = 3t / (1 + 2t); t = 0.5 -> 0.75.
    assert ts[0] == 1 and ts[-1] == 0 and math.isclose(float(ts[2]), 0.75, rel_tol=1e-6)
    assert cfg_active(0.5, (0.4, 1.0)) and not cfg_active(0.4, (0.4, 1.0))
    g = torch.Generator().manual_seed(0)
    vc, vt, vi = (torch.randn(6, 4, generator=g) for _ in range(3))
    assert cfg_combine(vc, vt, vi, text_scale=1.0, img_scale=3.0) is vc  # st <= 1: no guidance
    v1 = vt + 4 * (vc - vt)
    v2 = vi + 2 * (v1 - vi)
    exp = v2 * (vc.norm() / (v2.norm() + 1e-8)).clamp(0, 1)
    torch.testing.assert_close(cfg_combine(vc, vt, vi, text_scale=4, img_scale=2), exp)
    exp_c = v2 * (vc.norm(dim=-1, keepdim=True) / (v2.norm(dim=-1, keepdim=True) + 1e-8)).clamp(0, 1)
    torch.testing.assert_close(cfg_combine(vc, vt, vi, text_scale=4, img_scale=2, renorm_type="channel"), exp_c)
    v1r = v1 * (vc.norm(dim=-1, keepdim=True) / (v1.norm(dim=-1, keepdim=True) + 1e-8)).clamp(0, 1)
    torch.testing.assert_close(cfg_combine(vc, vt, vi, text_scale=4, img_scale=2, renorm_type="text_channel"),
                               vi + 2 * (v1r - vi))
    with pytest.raises(ValueError, match="global"):
        cfg_combine(vc, vt, vi, text_scale=4, img_scale=2, renorm_type="nope")


def test_packing_roundtrip_and_masks():
    from magi_zoo.adapters.bagel.packing import causal_mask, grid_position_ids, patchify, sincos_2d, unpatchify

    x = torch.randn(16, 8, 12)
    t = patchify(x, 2)
    assert t.shape == (4 * 6, 64)
    # token (r=1, c=2), feature (pr=1, pc=0, ch=3) = x[3, 2*1+1, 2*2+0]
    assert t[1 * 6 + 2, (1 * 2 + 0) * 16 + 3] == x[3, 3, 4]
    torch.testing.assert_close(unpatchify(t, 4, 6, 2, 16), x)
    assert grid_position_ids(2, 3, 64).tolist() == [0, 1, 2, 64, 65, 66]
    m = causal_mask(2, 5)  # bottom-right: the 2 new tokens see the 3 cached ones
    assert m.tolist() == [[True, True, True, True, False], [True] * 5]
    tab = sincos_2d(8, 4)  # first half encodes the column, second half the row
    assert torch.allclose(tab[1, :4], tab[5, :4]) and torch.allclose(tab[4, 4:], tab[5, 4:])
    assert tab[0, 0] == 0 and tab[0, 2] == 1  # sin(0) then cos(0)


# -- end to end ----------------------------------------------------------------------------------
def test_tokenizer_has_qwen_specials(tiny):
    tok = tiny.pipe.tokenizer
    for name, i in tiny.pipe.special_ids.items():
        assert tok.convert_tokens_to_ids(name) == i
    assert tiny.pipe.text_ids("hi")[0] == tiny.pipe.special_ids["<|im_start|>"]


def test_understanding_and_t2i_compiled_equal_eager(tiny):
    """Eager vs every region compiled: tokens identical, image within fp32 tolerance."""
    pipe = tiny.pipe
    img = _image()
    ans0 = pipe.understand(img, "what is in the picture?", max_new_tokens=6)
    toks0 = pipe.generate_tokens(pipe.model.prefill_text(pipe.model.empty_context(), pipe.text_ids("hi")), 6)
    # cfg_img_scale 1.5 runs all three contexts; interval (0, 1] guides every step.
    kw = dict(height=48, width=32, num_inference_steps=3, cfg_img_scale=1.5, cfg_interval=(0.0, 1.0),
              seed=3, output_type="pt")
    im0 = pipe("a red fox", **kw)
    assert im0.shape == (3, 48, 32) and 0 <= im0.min() and im0.max() <= 1
    rep = _apply(tiny, ALL_EAGER)
    ans1 = pipe.understand(img, "what is in the picture?", max_new_tokens=6)
    toks1 = pipe.generate_tokens(pipe.model.prefill_text(pipe.model.empty_context(), pipe.text_ids("hi")), 6)
    im1 = pipe("a red fox", **kw)
    assert ans1 == ans0 and toks1 == toks0 and len(toks0) > 0
    torch.testing.assert_close(im1, im0, atol=1e-4, rtol=1e-4)
    assert rep.graph_breaks == 0
    # decode_step: dynamic from the first call, the growing KV length never recompiles:
    # 1 frame for both generate_tokens runs (the first run's 1st call compiles).
    dec = rep.region("model.decode_step")
    assert dec.counters.frames == 1 and not dec.counters.recompiles and dec.calls >= 2
    # denoise_step: 2 steps x 3 contexts = 6 calls; 2 frames: the non-empty contexts share
    # one symbolic graph, the empty no-text context (KV length 0, which dynamo specialises)
    # gets its own -> exactly 1 recompile.
    den = rep.region("model.denoise_step")
    assert den.calls == 6 and den.counters.frames == 2 and len(den.counters.recompiles) == 1
    assert "size()[0]" in den.counters.recompiles[0]
    # The ViT ran once, one graph, no break.
    vit = rep.region("model.vit_model")
    assert (vit.calls, vit.counters.frames, vit.counters.n_graph_breaks) == (1, 1, 0)


def test_layers_one_frame_for_all_layers(tiny):
    """N=3 MoT layers -> 1 compiled frame, 0 recompiles, in one prefill.

    Derivation: the layer's forward reads only tensors and attributes equal across layers
    (no layer_idx; each layer is handed its own cache tensors), so under no_grad layer 0's
    guards (module type, tensor shapes/dtypes) hold for layers 1 and 2: 1 frame, 3 calls."""
    pipe = tiny.pipe
    rep = _apply(tiny, {"BagelMoTLayer": {"backend": "eager", "fullgraph": True}})
    n = len(pipe.model.layers)
    assert n == 3
    with torch.no_grad():
        pipe.model.prefill_text(pipe.model.empty_context(), pipe.text_ids("a cat"))
    r = rep.region("BagelMoTLayer")
    assert (r.calls, r.counters.frames, len(r.counters.recompiles), r.counters.n_graph_breaks) == (n, 1, 0, 0)


def test_vit_fullgraph_zero_breaks_thanks_to_custom_op(tiny, monkeypatch):
    """The varlen op keeps the ViT one graph with fullgraph=True; the same attention
    fenced off with torch.compiler.disable instead cannot compile with fullgraph."""
    from magi_zoo.adapters.bagel import vit as vit_mod
    from magi_zoo.engine import custom_op_info

    info = custom_op_info("bagel_varlen_attention")
    assert info.is_subgraph_boundary
    m = tiny.pipe.model
    g = torch.Generator().manual_seed(0)
    # Two images packed: 6 and 10 patches.
    patches = torch.randn(16, 14 * 14 * 3, generator=g)
    pos = torch.arange(16)
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    ref = m.vit_model(patches, pos, cu)
    # Packing keeps images apart: image 0 alone gives the same features.
    torch.testing.assert_close(m.vit_model(patches[:6], pos[:6], cu[:2]), ref[:6], atol=1e-5, rtol=1e-5)
    rep = _apply(tiny, {"model.vit_model": {"backend": "aot_eager", "fullgraph": True}})
    out = m.vit_model(patches, pos, cu)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    r = rep.region("model.vit_model")
    assert (r.counters.frames, r.counters.graphs, r.counters.n_graph_breaks) == (1, 1, 0)

    # Counter-example: the same attention behind torch.compiler.disable breaks fullgraph.
    magi_zoo.engine.remove(tiny.modules)
    op = vit_mod.bagel_varlen_attention
    monkeypatch.setattr(vit_mod, "bagel_varlen_attention", torch.compiler.disable(lambda q, k, v, c: op(q, k, v, c)))
    torch.compiler.reset()
    with pytest.raises(Exception, match="(?i)disable|skip"):
        torch.compile(m.vit_model, fullgraph=True, backend="eager")(patches, pos, cu)


def test_inductor_decode_step_matches_eager(tiny):
    """One small inductor compile (generated code matters): the whole decode step."""
    pipe = tiny.pipe
    ctx = pipe.model.prefill_text(pipe.model.empty_context(), pipe.text_ids("hello"))
    ref = pipe.generate_tokens(ctx, 5)
    tok = torch.tensor([pipe.special_ids["<|im_start|>"]])
    pos = torch.tensor([ctx.rope])
    with torch.no_grad():
        l0, _, _ = pipe.model.decode_step(tok, pos, ctx.keys, ctx.values)
    rep = _apply(tiny, {"model": {"decode_step": {"fullgraph": True, "dynamic": True}}})
    with torch.no_grad():
        l1, _, _ = pipe.model.decode_step(tok, pos, ctx.keys, ctx.values)
    torch.testing.assert_close(l1, l0, atol=1e-4, rtol=1e-4)
    assert pipe.generate_tokens(ctx, 5) == ref
    r = rep.region("model.decode_step")
    assert r.counters.frames == 1 and r.counters.n_graph_breaks == 0 and not r.counters.recompiles


def test_bad_override_is_plan_error(tiny):
    with pytest.raises(magi_zoo.PlanError, match="BagelMoTLayer"):
        _apply(tiny, {"BagelMoTLayr": EAGER})
    with pytest.raises(magi_zoo.PlanError, match="denoise_step"):
        _apply(tiny, {"model": {"denoise_stp": EAGER}})


def test_gpu_spec_sections_resolve(tiny):
    """h100: the layer region symbolic (static shapes exhausted the recompile limit, see
    bagel.toml), denoise_step fenced (layers stay regional), decode whole, the editing
    prefill fenced."""
    from magi_zoo.engine import resolve
    from magi_zoo.specs import get_profile

    layers = spec_layers(tiny.adapter, get_profile("h100"))
    plan = resolve(tiny.modules, layers)
    by = {(t.path, t.method): t.spec for t in plan.targets}
    assert by[("model", "denoise_step")].enabled is False
    assert by[("model", "decode_step")].dynamic is True
    assert by[("model.language_model.model.layers.2", "forward")].dynamic is True
    assert by[("model", "prefill_vae_block")].enabled is False


# -- checkpoint in the official layout -------------------------------------------------------
def _official_ae_names(ch: list[int], nrb: int) -> list[str]:
    """BFL FLUX AE key names (no prefix), enumerated from the original module tree."""
    names = ["encoder.conv_in", "encoder.norm_out", "encoder.conv_out",
             "decoder.conv_in", "decoder.norm_out", "decoder.conv_out"]
    res = ["norm1", "conv1", "norm2", "conv2"]
    for i in range(len(ch)):
        cin = ch[i - 1] if i else ch[0]
        for j in range(nrb):
            names += [f"encoder.down.{i}.block.{j}.{r}" for r in res]
            if j == 0 and cin != ch[i]:
                names.append(f"encoder.down.{i}.block.0.nin_shortcut")
        if i < len(ch) - 1:
            names.append(f"encoder.down.{i}.downsample.conv")
    for part in ("encoder", "decoder"):
        for b in ("block_1", "block_2"):
            names += [f"{part}.mid.{b}.{r}" for r in res]
        names += [f"{part}.mid.attn_1.{x}" for x in ("norm", "q", "k", "v", "proj_out")]
    cin = ch[-1]
    for i in reversed(range(len(ch))):
        for j in range(nrb + 1):
            names += [f"decoder.up.{i}.block.{j}.{r}" for r in res]
            if j == 0 and cin != ch[i]:
                names.append(f"decoder.up.{i}.block.0.nin_shortcut")
            cin = ch[i]
        if i > 0:
            names.append(f"decoder.up.{i}.upsample.conv")
    return [f"{n}.{w}" for n in names for w in ("weight", "bias")]


def test_checkpoint_official_layout_loads_every_tensor(tiny, tmp_path):
    """`save_bagel_checkpoint` writes ema.safetensors / ae.safetensors / llm_config.json /
    vit_config.json with the official names; loading through the adapter puts every
    tensor back where it belongs. The AE names are checked against an enumeration of the
    original module tree (independent of the key mapping), so a mapping that merely
    round-trips with its own inverse would still fail here."""
    from safetensors.torch import load_file

    from magi_zoo.adapters.bagel.adapter import build_modules
    from magi_zoo.adapters.bagel.checkpoint import save_bagel_checkpoint

    cfg = tiny.pipe.config
    # A separate copy with a unique random value in every tensor (the fixture stays as is).
    model, vae = build_modules(cfg, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in [*model.state_dict().values(), *vae.state_dict().values()]:
            t.copy_(torch.randn(t.shape, generator=g))
    save_bagel_checkpoint(model, vae, cfg, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ae.safetensors", "ema.safetensors", "llm_config.json", "vit_config.json"]
    ema, ae = load_file(str(tmp_path / "ema.safetensors")), load_file(str(tmp_path / "ae.safetensors"))
    official_ema = {"language_model.model.layers.0.self_attn.q_proj_moe_gen.weight",
                    "language_model.model.layers.2.mlp_moe_gen.gate_proj.weight",
                    "language_model.model.norm_moe_gen.weight", "language_model.lm_head.weight",
                    "vit_model.vision_model.encoder.layers.1.self_attn.out_proj.bias",
                    "vit_model.vision_model.post_layernorm.weight", "connector.fc1.weight", "vae2llm.bias",
                    "llm2vae.weight", "time_embedder.mlp.2.weight", "latent_pos_embed.pos_embed",
                    "vit_pos_embed.pos_embed"}
    assert official_ema <= set(ema)
    # The BFL names exactly (a bijection with the diffusers AE: nothing left over on either side).
    assert set(ae) == set(_official_ae_names(cfg["vae"]["block_out_channels"], cfg["vae"]["layers_per_block"]))
    assert len(ae) == len(vae.state_dict())
    assert ae["encoder.mid.attn_1.q.weight"].shape == (64, 64, 1, 1)  # 1x1 convs in the original AE
    # The official vit_config.json counts the SigLIP layer BAGEL drops.
    assert json.loads((tmp_path / "vit_config.json").read_text())["num_hidden_layers"] == cfg["vit"]["num_hidden_layers"] + 1

    h = magi_zoo.load("bagel-tiny", gpu="cpu", weights=str(tmp_path), compile=False)
    got = h.pipe.model.state_dict()
    assert set(got) == set(ema)
    for k, v in ema.items():
        assert torch.equal(got[k], v), k
    gv = h.pipe.vae.state_dict()
    # Each written AE tensor appears exactly once in the model (values are unique randoms),
    # checked without the key mapping; then a few mappings spelled out.
    written = {round(float(v.double().sum()), 6): n for n, v in ae.items()}
    landed = {round(float(v.double().sum()), 6) for v in gv.values()}
    assert landed == set(written)
    assert torch.equal(gv["decoder.up_blocks.3.resnets.0.conv_shortcut.weight"], ae["decoder.up.0.block.0.nin_shortcut.weight"])
    assert torch.equal(gv["decoder.up_blocks.0.upsamplers.0.conv.bias"], ae["decoder.up.3.upsample.conv.bias"])
    assert torch.equal(gv["encoder.mid_block.attentions.0.to_q.weight"], ae["encoder.mid.attn_1.q.weight"][:, :, 0, 0])
    assert torch.equal(gv["encoder.down_blocks.1.resnets.0.conv_shortcut.bias"], ae["encoder.down.1.block.0.nin_shortcut.bias"])
    assert torch.equal(gv["encoder.conv_norm_out.weight"], ae["encoder.norm_out.weight"])
    # A checkpoint of other sizes is refused with the field named.
    llm = json.loads((tmp_path / "llm_config.json").read_text())
    (tmp_path / "llm_config.json").write_text(json.dumps(dict(llm, hidden_size=128)))
    with pytest.raises(ValueError, match="hidden_size"):
        magi_zoo.load("bagel-tiny", gpu="cpu", weights=str(tmp_path), compile=False)


# -- CLI entry ---------------------------------------------------------------------------------
def test_run_text_to_image_and_understanding(tiny, tmp_path):
    from PIL import Image

    from magi_zoo.cli import generate_to

    [out] = generate_to(tiny, prompt="a red fox", out=tmp_path / "image.png", progress=False, image=None,
                        audio_out=None, num_inference_steps=2, height=32, width=48, num_frames=None,
                        max_new_tokens=None, seed=0)
    assert Image.open(out).size == (48, 32)
    _image().save(tmp_path / "in.png")
    [ans] = generate_to(tiny, prompt="what is this?", out=tmp_path / "answer.txt", progress=False,
                        image=str(tmp_path / "in.png"), task="understand", max_new_tokens=4,
                        num_inference_steps=None)
    assert ans.read_text().endswith("\n")
    # Options and output files are checked before any work, by the adapter's declarations.
    with pytest.raises(ValueError, match="--frames"):
        tiny.adapter.check_run(tiny.variant, dict(num_frames=9), tmp_path / "v.png")
    with pytest.raises(ValueError, match="max-new-tokens"):
        tiny.adapter.check_run(tiny.variant, dict(max_new_tokens=4), tmp_path / "i.png")
    with pytest.raises(ValueError, match=r"writes \.txt"):
        tiny.adapter.check_run(tiny.variant, dict(image="in.png", task="understand"), tmp_path / "answer.png")


def test_image_by_path_is_read_and_anything_else_is_refused(tiny, tmp_path):
    """image= takes a PIL image or a file's path: a path is read (it was passed on as a text item
    and failed deep in the edit with a TypeError), a missing or unreadable file and other types
    are errors naming the argument, before the model runs."""
    from PIL import Image

    path = tmp_path / "in.png"
    _image().save(path)
    by_path = tiny("what is it", image=str(path), task="understand", max_new_tokens=3)
    assert by_path == tiny("what is it", image=Image.open(path), task="understand", max_new_tokens=3)
    with pytest.raises(FileNotFoundError, match="image '.*none.png': no such file"):
        tiny("x", image=str(tmp_path / "none.png"))
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ValueError, match="not an image PIL can read"):
        tiny("x", image=tmp_path / "text.png")
    # refused by the handle's checks before the pipeline (`Adapter.image_kinds`, `prompt_lists`)
    with pytest.raises(TypeError, match="image must be a PIL image or a file's path, got ndarray"):
        tiny("x", image=np.zeros((8, 8, 3)))
    with pytest.raises(TypeError, match="prompt must be a string \\(one prompt per call\\), got int"):
        tiny(5)
    with pytest.raises(TypeError, match="image: a PIL image or an image file's path, got ndarray"):
        tiny.pipe("x", image=np.zeros((8, 8, 3)))  # the pipeline's own check, for callers of `.pipe`
