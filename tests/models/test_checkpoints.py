"""Checkpoints: safetensors only, never pickle code; a truncated or mismatched checkpoint is
an error that names the file and the first bad tensor (BAGEL's official-layout loader)."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from magi_zoo.adapters.bagel.checkpoint import (
    _load_exact,
    load_bagel_checkpoint,
    read_safetensors,
    save_bagel_checkpoint,
)

from helpers import REPO


@pytest.fixture(scope="module")
def bagel_ckpt(tmp_path_factory):
    """The tiny BAGEL modules and their checkpoint in the official layout."""
    from magi_zoo import adapters
    from magi_zoo.adapters.bagel.adapter import build_modules

    _, variant = adapters.lookup("bagel-tiny")
    cfg = dict(variant.config)
    model, vae = build_modules(cfg, torch.float32, torch.device("cpu"))
    path = save_bagel_checkpoint(model, vae, cfg, tmp_path_factory.mktemp("bagel"))
    return model, vae, path


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_intact_checkpoint_loads(bagel_ckpt):
    model, vae, path = bagel_ckpt
    n = load_bagel_checkpoint(model, vae, path)
    # every tensor of both modules (the position tables are in the file too: all of them)
    assert n == {"model": len(model.state_dict()), "vae": len(vae.state_dict())}


def _data_order(file: Path) -> list[str]:
    import json

    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = {k: v for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def test_truncated_ema_names_file_and_first_incomplete_tensor(bagel_ckpt, tmp_path):
    model, vae, path = bagel_ckpt
    d = _copy(path, tmp_path / "ckpt")
    ema = d / "ema.safetensors"
    order = _data_order(ema)
    raw = ema.read_bytes()
    ema.write_bytes(raw[:-1])  # one byte short: only the last tensor in the data section is torn
    with pytest.raises(ValueError) as e:
        load_bagel_checkpoint(model, vae, d)
    msg = str(e.value)
    assert str(ema) in msg and "truncated" in msg
    # the last tensor by offset is the first (and only) incomplete one
    assert f"tensor {order[-1]!r} (the first incomplete one, {len(order) - 1} of {len(order)}" in msg


def test_file_cut_in_half_names_the_tensor_at_the_cut(bagel_ckpt, tmp_path):
    _, _, path = bagel_ckpt
    f = tmp_path / "ae.safetensors"
    raw = (path / "ae.safetensors").read_bytes()
    f.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ValueError, match=re.escape(str(f)) + r".*truncated: tensor '[^']+' \(the first incomplete"):
        read_safetensors(f)
    f.write_bytes(raw[:20])  # inside the header
    with pytest.raises(ValueError, match=re.escape(str(f)) + ".*truncated inside the header"):
        read_safetensors(f)
    f.write_bytes(b"\x01")
    with pytest.raises(ValueError, match="shorter than a safetensors header"):
        read_safetensors(f)


def test_wrong_shape_names_file_and_tensor(bagel_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    model, vae, path = bagel_ckpt
    d = _copy(path, tmp_path / "ckpt")
    ema = load_file(str(d / "ema.safetensors"))
    ema["connector.fc1.weight"] = torch.zeros(3, 5)
    save_file(ema, str(d / "ema.safetensors"))
    with pytest.raises(ValueError) as e:
        load_bagel_checkpoint(model, vae, d)
    want = tuple(model.state_dict()["connector.fc1.weight"].shape)
    assert str(e.value).startswith(f"{d / 'ema.safetensors'}: tensor 'connector.fc1.weight' has shape (3, 5) "
                                   f"in the file but the model expects {want} (the first of 1 shape mismatches)")


def test_wrong_shape_in_ae_uses_the_file_s_name(bagel_ckpt, tmp_path):
    # ae.safetensors holds BFL names; the error names the tensor as the file spells it.
    from safetensors.torch import load_file, save_file

    model, vae, path = bagel_ckpt
    d = _copy(path, tmp_path / "ckpt")
    ae = load_file(str(d / "ae.safetensors"))
    ae["encoder.norm_out.weight"] = torch.zeros(7)
    save_file(ae, str(d / "ae.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"{d / 'ae.safetensors'}: tensor 'encoder.norm_out.weight' "
                                                   "has shape (7,)")):
        load_bagel_checkpoint(model, vae, d)


def test_missing_and_unexpected_name_the_first():
    m = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4))
    state = {k: v.clone() for k, v in m.state_dict().items()}
    del state["1.weight"]
    state["2.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"^ckpt/x.safetensors: tensor '1.weight' is missing \(the first of 1 "
                                         r"missing\); tensor '2.weight' is not in the model"):
        _load_exact(m, state, "ckpt/x.safetensors")


def test_every_torch_load_is_weights_only():
    # Unpickling a checkpoint can run arbitrary code; torch.load(..., weights_only=True)
    # cannot. Every call in the project (package, benchmarks, scripts, tests) must say so.
    calls = []
    for f in REPO.rglob("*.py"):
        if any(part.startswith(".") or part in ("venv", "build", "site-packages") for part in f.relative_to(REPO).parts):
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r"torch\.load\(", text):
            line = text.count("\n", 0, m.start()) + 1
            # the call's argument list, up to its matching parenthesis
            depth, i = 1, m.end()
            while depth and i < len(text):
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            calls.append((f"{f.relative_to(REPO)}:{line}", "weights_only=True" in text[m.end():i]))
    assert [where for where, ok in calls if not ok] == []
