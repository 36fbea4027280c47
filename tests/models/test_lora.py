"""LoRA through diffusers' loaders and peft (magi_zoo/adapters/lora.py), on wan2.1-tiny.

The oracle for a fused LoRA is the same LoRA run unfused by peft (diffusers'
`load_lora_weights` + `set_adapters` at the scale): the fused weights must give its output.
Files are tiny and written in the published key layouts (tests/helpers/lora_files.py).
"""

import copy
import sys

import pytest
import torch
import torch.nn as nn
from helpers.lora_files import diffusers_lora, flux_lora, kohya_lora, original_wan_lora

import magi_zoo
from magi_zoo.adapters import lora
from magi_zoo.cli import main

pytest.importorskip("peft")

EAGER = {"WanTransformerBlock": {"backend": "eager", "fullgraph": True}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    return {"diffusers": diffusers_lora(d / "style.safetensors"),
            "diffusers_b": diffusers_lora(d / "other.safetensors", rank=8, seed=5),
            "kohya": kohya_lora(d / "kohya.safetensors"),
            "original": original_wan_lora(d / "lightx2v_distill.safetensors", alpha=8.0),
            "original_m": original_wan_lora(d / "with_modulation.safetensors", modulation=0.05),
            "flux": flux_lora(d / "flux.safetensors"),
            "flux_kohya": flux_lora(d / "flux_kohya.safetensors", kohya=True),
            "wide": diffusers_lora(d / "wide.safetensors", dim=64)}


@pytest.fixture(scope="module")
def base():
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant)
    with torch.inference_mode():
        y = h.pipe.transformer(**kw)[0]
    return h, kw, y


def _forward(pipe, kw):
    with torch.inference_mode():
        return pipe.transformer(**kw)[0]


@pytest.mark.parametrize("layout", ["diffusers", "kohya", "original"])
def test_fused_lora_equals_peft_unfused(base, files, layout):
    h, kw, y0 = base
    ref_pipe = copy.deepcopy(h.pipe)
    ref_pipe.load_lora_weights(str(files[layout]), adapter_name="ref")
    ref_pipe.set_adapters(["ref"], [0.7])
    ref = _forward(ref_pipe, kw)

    pipe = copy.deepcopy(h.pipe)
    specs = lora.lora_specs([(files[layout], 0.7)])
    states = lora.prepare(specs, pipe, h.adapter.components(pipe), "wan2.1-tiny")
    state = lora.attach(pipe, specs, states)
    assert type(pipe.transformer.blocks[0].attn1.to_q) is nn.Linear  # peft layers gone, weights merged
    out = _forward(pipe, kw)
    assert (out - y0).abs().max() > 1e-3  # the LoRA changes the output
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert state.layers[0] == {"diffusers": 16, "kohya": 40, "original": 41}[layout]  # 4 blocks x (4, 10, 10) + head


def test_load_fuses_before_compile_and_reports(base, files, fresh_dynamo):
    """Fused at load: the compiled blocks are the base model's (one compile for 4 blocks, no
    recompile); two LoRAs at their own scales equal the same two run unfused by peft."""
    h, kw, _ = base
    pair = [(files["diffusers"], 0.5), {"source": str(files["kohya"]), "scale": 2.0}]
    f = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=EAGER, lora=pair, lora_scale=0.5)
    out = _forward(f.pipe, kw)
    r = f.report()
    assert (r.frames, r.recompiles, r.graph_breaks) == (1, 0, 0)  # 4 identical blocks, one compile
    assert [s.scale for s in f.lora.specs] == [0.25, 1.0]  # per-LoRA scale x lora_scale
    assert r.notes == f.lora.lines() and "LoRA style:" in str(r) and "scale 0.25" in str(r)
    assert "fused at load" in r.notes[1] and r.to_dict()["notes"] == r.notes

    ref_pipe = copy.deepcopy(h.pipe)
    ref_pipe.load_lora_weights(str(files["diffusers"]), adapter_name="a")
    ref_pipe.load_lora_weights(str(files["kohya"]), adapter_name="b")
    ref_pipe.set_adapters(["a", "b"], [0.25, 1.0])
    torch.testing.assert_close(out, _forward(ref_pipe, kw), rtol=1e-4, atol=1e-5)


def test_hotswap_on_compiled_model_recompiles_nothing(base, files, fresh_dynamo):
    h, kw, _ = base
    hs = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=EAGER, lora=[files["diffusers"]], lora_hotswap=8)
    first = _forward(hs.pipe, kw)
    r = hs.report()
    assert (r.frames, r.recompiles) == (1, 0)
    hs.swap_lora(files["diffusers_b"], scale=0.5)  # rank 8 into the rank-8 slot (target_rank)
    swapped = _forward(hs.pipe, kw)
    assert (r.frames, r.recompiles, r.graph_breaks) == (1, 0, 0)  # the swap changed tensors only
    assert "other" in r.notes[0] and "scale 0.5" in r.notes[0] and "hot-swappable" in r.notes[0]
    assert (swapped - first).abs().max() > 1e-3
    ref_pipe = copy.deepcopy(h.pipe)
    ref_pipe.load_lora_weights(str(files["diffusers_b"]), adapter_name="b")
    ref_pipe.set_adapters(["b"], [0.5])
    torch.testing.assert_close(swapped, _forward(ref_pipe, kw), rtol=1e-4, atol=1e-5)


def test_full_deltas_the_converter_leaves_out_are_added_at_the_scale(base, files):
    """A LightX2V-layout LoRA's modulation deltas (`diff_m`), which its authors' loader adds to
    each block's modulation at the LoRA's strength and diffusers' converter drops: fused here
    on top of the low-rank part (the oracle: peft's unfused LoRA on a copy whose modulations
    carry the deltas); all-zero norm deltas are counted; hotswap is refused before the build."""
    from safetensors.torch import load_file

    h, kw, _ = base
    raw = load_file(str(files["original_m"]))
    delta = [raw[f"diffusion_model.blocks.{i}.diff_m"] for i in range(len(h.pipe.transformer.blocks))]
    pipe = copy.deepcopy(h.pipe)
    specs = lora.lora_specs([(files["original_m"], 0.7)])
    state = lora.attach(pipe, specs, lora.prepare(specs, pipe, h.adapter.components(pipe), "wan2.1-tiny"))
    for block, base_block, d in zip(pipe.transformer.blocks, h.pipe.transformer.blocks, delta):
        torch.testing.assert_close(block.scale_shift_table, base_block.scale_shift_table + 0.7 * d)
    assert state.lines()[0].endswith("4 full deltas added (modulation / norms), 8 all-zero full deltas skipped")

    ref_pipe = copy.deepcopy(h.pipe)
    with torch.no_grad():
        for block, d in zip(ref_pipe.transformer.blocks, delta):
            block.scale_shift_table += 0.7 * d
    ref_pipe.load_lora_weights(str(files["original_m"]), adapter_name="ref")
    ref_pipe.set_adapters(["ref"], [0.7])
    torch.testing.assert_close(_forward(pipe, kw), _forward(ref_pipe, kw), rtol=1e-4, atol=1e-5)

    zeros = lora.prepare(lora.lora_specs([files["original"]]), h.pipe, h.adapter.components(h.pipe), "wan2.1-tiny")
    assert (zeros[0].deltas, lora.describe_deltas(zeros[0])) == ({}, "; 12 all-zero full deltas skipped")
    with pytest.raises(ValueError, match=r"with_modulation.safetensors' carries 4 full delta\(s\) besides its low-rank "
                                         r"layers \(e.g. blocks.0.scale_shift_table\), which hot-swapping cannot"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False, lora=[files["original_m"]], lora_hotswap=True)


def test_full_deltas_in_a_layout_with_no_map_are_said_not_applied(tmp_path):
    """Kohya-named delta entries (no parameter map here; diffusers' converters drop them too):
    a non-zero one is reported as not applied, a zero one as skipped."""
    from safetensors.torch import save_file

    from magi_zoo.adapters import lora_deltas

    path = tmp_path / "kohya_norm.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_norm_key_norm.diff": torch.ones(4),
               "lora_unet_double_blocks_0_img_attn_norm_query_norm.diff": torch.zeros(4)}, str(path))
    state = lora_deltas.with_deltas(lora_deltas.ConvertedLora(), str(path), {})
    assert (state.deltas, state.unmapped, state.zero_deltas) == ({}, 1, 1)
    assert lora.describe_deltas(state) == ("; 1 all-zero full deltas skipped, 1 non-zero full deltas NOT applied (a "
                                           "layout with no parameter map here; diffusers drops them too)")


def test_lora_of_another_family_or_size_is_refused_before_the_build(files, monkeypatch):
    built = []
    adapter, _ = magi_zoo.adapters.lookup("wan2.1-tiny")
    real = type(adapter).build
    monkeypatch.setattr(type(adapter), "build", lambda self, v, **kw: built.append(kw["device"]) or real(self, v, **kw))
    with pytest.raises(ValueError, match=r"flux.safetensors' matches no layer of wan2.1-tiny: its keys look like "
                                         r"a Flux LoRA.*names its layers like"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False, lora=[files["flux"]])
    with pytest.raises(ValueError, match=r"flux_kohya.safetensors' cannot be read as a LoRA for wan2.1-tiny: its "
                                         r"keys look like a Flux LoRA"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False, lora=[files["flux_kohya"]])
    with pytest.raises(ValueError, match=r"wide.safetensors' does not fit wan2.1-tiny: 32 layer\(s\) at other "
                                         r"shapes, e.g. transformer.blocks.0.attn1.to_\w+ \(in 64, the model's 32\)"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False, lora=[files["wide"]])
    assert {d.type for d in built} == {"meta"}  # only the meta-device check ran: no weights were made


def test_bad_lora_arguments(files, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"missing.safetensors': no such file; pass a LoRA .safetensors file or a hub id"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False, lora=[tmp_path / "missing.safetensors"])
    with pytest.raises(ValueError, match=r"'someorg/loras/x.safetensors': no such local file, and as a hub id "
                                         r"\(someorg/loras, x.safetensors\) it is not in the local hub cache"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False, lora=["someorg/loras/x.safetensors"])  # tests are offline
    assert main(["run", "wan2.1-tiny", "--prompt", "x", "--out", str(tmp_path / "a.gif"), "--gpu", "cpu",
                 "--lora", str(tmp_path / "nope.safetensors:0.5")]) == 2  # refused before the build
    with pytest.raises(ValueError, match="does not take LoRA"):
        lora.prepare([lora.LoraSpec(str(files["diffusers"]))], object(), {}, "bagel-tiny")
    with pytest.raises(ValueError, match="lora_hotswap=True needs lora"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", lora_hotswap=True)
    with pytest.raises(ValueError, match="given twice"):
        lora.lora_specs([files["diffusers"], (files["diffusers"], 0.5)])
    monkeypatch.setitem(sys.modules, "peft", None)  # peft not installed
    with pytest.raises(ValueError, match=r"LoRA needs peft, which is not installed: pip install 'magi-zoo\[lora\]'"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False, lora=[files["diffusers"]])


def test_cli_lora_parsing_and_spec(files, capsys):
    assert lora.parse_cli("a.safetensors:0.8") == lora.LoraSpec("a.safetensors", 0.8)
    assert lora.parse_cli("transformer_2=low.safetensors") == lora.LoraSpec("low.safetensors", 1.0, "transformer_2")
    assert lora.parse_cli("org/name/x.safetensors") == lora.LoraSpec("org/name/x.safetensors", 1.0)
    assert main(["spec", "wan2.1-tiny", "--gpu", "cpu", "--lora", f"{files['original']}:0.5"]) == 0
    out = capsys.readouterr().out
    assert "LoRA lightx2v_distill:" in out and "(scale 0.5), 41 layers, fused at load" in out
    assert main(["spec", "wan2.1-tiny", "--gpu", "cpu", "--lora", str(files["flux"])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("magi-zoo: error: lora ") and "Flux LoRA" in err and "wan2.1-tiny" in err


@pytest.mark.parametrize("entry, match", [
    ([("a.safetensors", "2")], r"scale '2' is not a finite number"),
    ([("a.safetensors", True)], r"scale True is not a finite number"),
    ([{"source": "a.safetensors", "scale": "3"}], r"scale '3' is not a finite number"),
    ([("a.safetensors", float("nan"))], r"scale nan is not a finite number"),
    ([("a.safetensors", float("inf"))], r"scale inf is not a finite number"),
    ([(3, 1.0)], r"lora source 3: a \.safetensors path"),
    (123, r"lora=123: pass a path or hub id"),
])
def test_lora_entries_are_not_converted(entry, match):
    """A scale or source of the wrong kind is named, not cast (a scale "2" was merged at 2, True at 1)."""
    with pytest.raises(ValueError, match=match):
        lora.lora_specs(entry)


def test_lora_scale_needs_a_lora_and_a_finite_number():
    with pytest.raises(ValueError, match=r"lora_scale=5\.0 without lora="):
        lora.lora_specs(None, 5.0)
    assert lora.lora_specs(None) == [] and lora.lora_specs(None, 1.0) == []
    with pytest.raises(ValueError, match=r"lora_scale=nan: a finite number"):
        lora.lora_specs(["a.safetensors"], float("nan"))


@pytest.mark.parametrize("text, match", [
    ("f.safetensors:abc", r"--lora 'f\.safetensors:abc': no file 'f\.safetensors:abc', and 'abc' after the last ':' "
                          r"is not a scale"),
    ("f.safetensors:nan", r"--lora 'f\.safetensors:nan': lora 'f\.safetensors': scale nan is not a finite number"),
    ("f.safetensors:1e400", r"scale inf is not a finite number"),
])
def test_cli_lora_scale_must_be_a_finite_number(text, match):
    with pytest.raises(ValueError, match=match):
        lora.parse_cli(text)


def test_a_colon_inside_an_existing_path_is_the_paths(tmp_path):
    f = tmp_path / "a:b.safetensors"
    f.write_bytes(b"")
    assert lora.parse_cli(str(f)) == lora.LoraSpec(str(f), 1.0)
