"""BAGEL's guidance combination and Euler step in the dtypes the official code uses.

tests/data/bagel_cfg_combine_oracle.json holds the official statements' results
(benchmarks/oracles/bagel_cfg_combine.py evaluates `Bagel._forward_flow`'s combination and
`generate_image`'s Euler update from the official source) on bf16 velocities, as the official
app's bf16 model under CUDA autocast produces them: the guidance arithmetic in bf16, the norms in
float32, 'channel' / 'text_channel' results promoted to float32 by their per-token scale, and
v * dt in bf16 before the float32 update. A combination computed in float32 and cast back
(what the code did before) is a few bf16 ulps off and returns bf16 where the official code
returns float32.
"""

import json
from pathlib import Path

import pytest
import torch

from magi_zoo.adapters.bagel.flow import cfg_combine, euler_sample

ORACLE = json.loads((Path(__file__).resolve().parents[2] / "data" / "bagel_cfg_combine_oracle.json").read_text())
V = {k: torch.tensor(ORACLE["inputs"][k], dtype=torch.bfloat16) for k in ("v_t", "cfg_text_v_t", "cfg_img_v_t")}
CASES = {f"{c['cfg_renorm_type']}-img{c['cfg_img_scale']}-min{c['cfg_renorm_min']}": c for c in ORACLE["cases"]}


def _ours(case, fn=cfg_combine):
    return fn(V["v_t"], V["cfg_text_v_t"], V["cfg_img_v_t"], text_scale=case["cfg_text_scale"],
              img_scale=case["cfg_img_scale"], renorm_type=case["cfg_renorm_type"], renorm_min=case["cfg_renorm_min"])


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> float:
    """Fraction of values not bit-equal (the oracle ran on the CPU: same kernels as here)."""
    return (got.float() != want).float().mean().item()


@pytest.mark.parametrize("name", sorted(CASES))
def test_combination_is_the_official_one_in_its_dtype(name):
    case = CASES[name]
    v = _ours(case)
    assert str(v.dtype) == case["dtype"], name
    # the norms reduce in float32 in another order on a GPU: allow rare one-ulp differences there
    assert _mismatch(v, torch.tensor(case["v"])) <= (0.0 if ORACLE["device"] == "cpu" else 0.02), name


@pytest.mark.parametrize("name", sorted(CASES))
def test_euler_update_is_the_official_one(name):
    case = CASES[name]
    x = torch.tensor(ORACLE["inputs"]["x_t"])
    ts = torch.tensor([1.0, 1.0 - ORACLE["dt"]], dtype=torch.float32)
    assert float(ts[0] - ts[1]) == ORACLE["dt"]  # the step size is the recorded 0-d float32 one
    out = euler_sample(x, ts, lambda xt, t: _ours(case))
    assert str(out.dtype) == case["x_next_dtype"]
    assert _mismatch(out, torch.tensor(case["x_next"])) <= (0.0 if ORACLE["device"] == "cpu" else 0.02), name


def test_a_float32_combination_is_not_the_official_one():
    """The check can fail: combining in float32 and casting back to bf16 (the former code)
    returns bf16 where the official code returns float32, and other bf16 values."""
    def float32_then_cast(v_c, v_t, v_i, **kw):
        return cfg_combine(v_c.float(), v_t.float(), v_i.float(), **kw).to(v_c.dtype)

    dtypes = [str(_ours(c, float32_then_cast).dtype) != c["dtype"] for c in CASES.values()]
    values = [_mismatch(_ours(c, float32_then_cast), torch.tensor(c["v"])) > 0.05
              for c in CASES.values() if c["dtype"] == "torch.bfloat16"]
    assert sum(dtypes) == 4 and all(values), (dtypes, values)
