"""fp8 checkpoints (magi_zoo/checkpoints.py, adapters/fp8_checkpoint.py) on wan2.1-tiny in bf16:
written by the engine's quantizer, read back as Fp8Linear without a bf16 copy, equal to
quantize-at-load, and half the host bytes."""

import copy
import json

import pytest
import torch
import torch.nn as nn

import magi_zoo
from magi_zoo.checkpoints import fp8_linears
from magi_zoo.engine import Fp8Linear
from magi_zoo.engine.precision import fp8_linear


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", dtype="bfloat16", compile=False)
    path = tmp_path_factory.mktemp("fp8") / "ckpt"
    h.save_pretrained(path, precision="fp8")
    return h, path


def _bytes(mods) -> int:
    return sum(t.numel() * t.element_size() for m in mods for t in [*m.parameters(), *m.buffers()])


def test_round_trip_is_quantize_at_load_without_a_bf16_copy(saved, monkeypatch):
    h, path = saved
    manifest = json.loads((path / "magi_zoo_fp8.json").read_text())
    names = manifest["components"]["transformer"]
    # the precision section's region (WanTransformerBlock): every block linear (4 attn1 + 4 attn2 + 2 FFN) x 4
    assert names == fp8_linears(h.adapter, h.pipe, h.profile)["transformer"] and len(names) == 40
    assert "blocks.0.ffn.net.0.proj" in names and "proj_out" not in names  # the output head stays bf16

    devices = []
    real = fp8_linear.rowwise_fp8
    monkeypatch.setattr(fp8_linear, "rowwise_fp8", lambda x: devices.append(x.device.type) or real(x))
    back = magi_zoo.load("wan2.1-tiny", gpu="cpu", dtype="bfloat16", weights=str(path), compile=False)
    assert set(devices) == {"meta"}  # only the empty shells: nothing was quantized at load, no bf16 source existed

    t0, t1 = h.pipe.transformer, back.pipe.transformer
    for n in names:
        got, ref = t1.get_submodule(n), Fp8Linear(t0.get_submodule(n))  # quantize-at-load's module
        assert isinstance(got, Fp8Linear) and got.weight_fp8.dtype == torch.float8_e4m3fn
        assert torch.equal(got.weight_fp8.view(torch.uint8), ref.weight_fp8.view(torch.uint8)), n
        assert torch.equal(got.weight_scale, ref.weight_scale) and torch.equal(got.bias, ref.bias), n
    for k, v in t0.state_dict().items():  # everything else as saved
        if not any(k.startswith(n + ".") for n in names):
            assert torch.equal(t1.state_dict()[k], v), k

    # one forward equals the bf16 model quantized at load (the same Fp8Linear swap)
    quant = copy.deepcopy(t0)
    for n in names:
        parent, _, leaf = n.rpartition(".")
        setattr(quant.get_submodule(parent), leaf, Fp8Linear(quant.get_submodule(n)))
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant)
    with torch.inference_mode():
        torch.testing.assert_close(t1(**kw)[0], quant(**kw)[0], rtol=0, atol=0)

    # host bytes of the block linears: fp8 (1 B) + a 4 B scale per row vs bf16's 2 B, biases as they were:
    # 32x32: (1024 + 128 + 64) / (2048 + 64) = 0.58; measured over all 40
    bf16 = _bytes(t0.get_submodule(n) for n in names)
    fp8 = _bytes(t1.get_submodule(n) for n in names)
    assert fp8 / bf16 < 0.6, (fp8, bf16)
    assert _bytes([t1]) < 0.75 * _bytes([t0])  # the whole tiny transformer (embedders, norms, head stay)


def test_fp8_checkpoint_errors(saved, tmp_path):
    h, path = saved
    with pytest.raises(ValueError, match=r"precision='int4'; choices: 'fp8' or None"):
        h.save_pretrained(tmp_path / "x", precision="int4")
    assert not (tmp_path / "x").exists()
    # nothing a user made is written over: a directory with files, or a file, is refused
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model_index.json").write_text("{}")
    for precision in (None, "fp8"):
        with pytest.raises(ValueError, match=r"save_pretrained's path '.*mine' is a directory that is not empty; "
                                             r"pass overwrite=True to write into it"):
            h.save_pretrained(mine, precision=precision)
    assert (mine / "model_index.json").read_text() == "{}"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"save_pretrained's path '.*afile' exists and is not a directory; pass a "
                                         r"directory"):
        h.save_pretrained(tmp_path / "afile")
    with pytest.raises(TypeError, match=r"overwrite takes bool, got int"):
        h.save_pretrained(mine, overwrite=1)
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(path, bad)
    (bad / "magi_zoo_fp8.json").write_text(json.dumps({"components": {"transformer": ["blocks.0.norm2"]}}))
    with pytest.raises(ValueError, match=r"'blocks.0.norm2' is not a linear of WanTransformer3DModel"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", dtype="bfloat16", weights=str(bad), compile=False)


def test_fp8_weights_are_what_offload_streams(saved):
    """The offload step streams a block's parameters and buffers: an fp8 checkpoint's blocks
    hold the fp8 buffers, not bf16 weights."""
    _, path = saved
    back = magi_zoo.load("wan2.1-tiny", gpu="cpu", dtype="bfloat16", weights=str(path), compile=False)
    block = back.pipe.transformer.blocks[0]
    dtypes = {t.dtype for m in block.modules() if isinstance(m, Fp8Linear) for t in m.buffers()}
    assert dtypes == {torch.float8_e4m3fn, torch.float32}
    assert not any(type(m) is nn.Linear for m in block.modules())


def test_precision_step_adopts_the_loaded_fp8_linears(saved):
    """With precision fp8 in the plan (a card with fp8), the checkpoint's Fp8Linears take the
    spec's fast accumulation and GELU fusion as swapped ones would; remove() puts them back."""
    from magi_zoo.specs import get_profile

    _, path = saved
    back = magi_zoo.load("wan2.1-tiny", gpu="cpu", dtype="bfloat16", weights=str(path), compile=False)
    t = back.pipe.transformer
    plan = {"precision": {"WanTransformerBlock": {"matmul": "fp8", "fast_accum": True, "fuse_gelu": True}}}
    rep = magi_zoo.apply(t, plan, gpu=get_profile("h100"))  # the precision step only: no kernel runs here
    assert "(0 linears, 40 already fp8 from the checkpoint, fast accumulation, 4 FeedForward GELU(s)" \
        in rep.step("precision").did
    assert t.blocks[0].attn1.to_q.fast_accum and t.blocks[0].ffn.net[2].input_gelu
    magi_zoo.remove(t)
    assert not t.blocks[0].attn1.to_q.fast_accum and isinstance(t.blocks[0].attn1.to_q, Fp8Linear)
