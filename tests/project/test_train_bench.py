"""benchmarks/train.py without a GPU: the strategy table maps to recompute specs the engine
accepts, and a results record renders (the CPU paths themselves: `--smoke`, see its docstring)."""

import json

import pytest
import torch

from benchmarks import train
from magi_zoo.specs import RecomputeSpec


def test_strategies_are_valid_recompute_specs():
    # Each strategy's own policy: a strategy mapped to the wrong one (or a new strategy left
    # out of this table) fails here, where "is one of the four policies" could not.
    expected = {"eager_full": "full", "regional_full": "full", "save_all": "selective",
                "auto16": "auto", "auto24": "auto", "auto40": "auto", "none": "none"}
    assert set(train.ALL_STRATEGIES) == set(expected)
    for s in train.ALL_STRATEGIES:
        value = train._recompute(s)
        spec = RecomputeSpec.from_shorthand(value) if isinstance(value, str) else RecomputeSpec(**value)
        assert spec.policy == expected[s], s
    assert train._recompute("save_all_sdpa") == train._recompute("save_all")  # the suffix only pins attention
    assert train._recompute("auto16")["train_peak_gib"] == 16.0
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        train._recompute("fast")
    assert train._block_keys("wan2.1-tiny") == ["WanTransformerBlock"]
    assert train._block_keys("flux-tiny") == ["FluxTransformerBlock", "FluxSingleTransformerBlock"]


def test_markdown_shows_rows_and_the_auto_choice():
    auto = {"WanTransformerBlock": {"choice": {"keep matmuls+attention": 12, "full": 18}, "blocks": 30,
                                    "estimated_peak_gib": 15.2, "budget_gib": 16.0, "live_gib": 2.9,
                                    "optimizer_states_gib": 4.9, "gradients_outside_blocks_gib": 0.1,
                                    "largest_block_backward_gib": 1.6, "blocks_kept_or_gradient_gib": 5.8,
                                    "kept_activations_gib": 3.4, "estimated_recompute_ms": 300.0,
                                    "options": [{"name": "full", "gib_per_block": 0.1, "recompute_ms_per_block": 20}]}}
    rec = {"kind": "single", "model": "m", "env": {"card": "X"}, "runs": 5, "warmup": 2, "step": "s",
           "results": [{"strategy": "auto16", "status": "ok", "ms_per_step": 1.0, "auto": auto},
                       {"strategy": "none", "status": "out of memory"}]}
    md = train.markdown(rec)
    assert "| auto16 " in md and "out of memory" in md
    assert "{'keep matmuls+attention': 12, 'full': 18} of 30 blocks; estimated peak 15.2 GiB of 16.0" in md
    assert "optimizer states 4.9 + gradients outside the blocks 0.1" in md and "max(kept, its gradient) 5.8" in md


def test_static_need_counts_weights_gradients_and_adamw_states():
    from benchmarks.train import static_need_bytes

    gib = 2 ** 30
    # Flux.1-dev's 11.9 G bf16 parameters: 95 GiB with AdamW (> 80 GB: not run), 48 without
    assert static_need_bytes(int(23.8 * gib), "adamw") == int(23.8 * gib) * 4
    assert static_need_bytes(int(23.8 * gib), "none") == int(23.8 * gib) * 2


def test_budgeted_rows_run_under_their_cap_and_a_bad_cap_is_refused():
    assert train.row_cap("auto16") == 16.0 and train.row_cap("auto24_sdpa") == 24.0
    assert train.row_cap("eager_full@16") == 16.0 and train.row_cap("save_all@40") == 40.0
    assert train.row_cap("eager_full") is None and train.row_cap("regional_full_sdpa") is None
    assert train._recompute("eager_full@16") == "full" and train._recompute("auto24")["train_peak_gib"] == 24.0
    train.check_strategies(["auto16", "eager_full@16", "auto24@20"])
    for bad, why in (("eager_full@x", "the cap after '@' is GiB"), ("auto16@0", "the cap after '@' is GiB"),
                     ("autox", "unknown strategy 'autox'"), ("auto", "unknown strategy 'auto'")):
        with pytest.raises(ValueError, match=why):
            train.check_strategies([bad])
    with pytest.raises(SystemExit):  # argparse's one line, before anything is built
        train.main(["--strategies", "auto16,eager_full@big", "--device", "cpu"])


def test_a_row_over_its_cap_is_a_failure_and_the_estimate_is_checked():
    ok = {"strategy": "auto16", "cap_gib": 16.0, "status": "ok", "ms_per_step": 1917.0,
          "peak_reserved_gib": 15.2, "process_peak_reserved_gib": 15.9}
    assert train.judge_cap(dict(ok))["status"] == "ok"
    over = train.judge_cap({**ok, "process_peak_reserved_gib": 18.1})
    assert over["status"] == "over cap" and "ms_per_step" not in over and over["over_cap_ms_per_step"] == 1917.0
    assert "18.1 GiB > the 16 GiB cap" in over["error"]
    assert train.judge_cap({**ok, "cap_gib": None, "peak_reserved_gib": 18.1})["status"] == "ok"  # uncapped
    auto = {"WanTransformerBlock": {"estimated_peak_bytes": 11 * 2 ** 30}}
    assert train.estimate_check(auto, 10 * 2 ** 30) == {"estimated_peak_gib": 11.0, "estimate_error": 0.1}
    assert train.estimate_check(None, 10 * 2 ** 30) == {}


def test_merge_adds_rows_of_the_same_run_and_refuses_another(tmp_path):
    env = {"card": "H100", "commit": "abc1234"}
    first = {"kind": "single", "model": "m", "step": "s", "runs": 3, "warmup": 1, "env": env,
             "results": [{"strategy": "eager_full@16", "ms_per_step": 2.0}, {"strategy": "auto16", "ms_per_step": 1.0}]}
    path = tmp_path / "r.json"
    assert train.merge_into(path, first) == first  # nothing there yet
    path.write_text(json.dumps(first))
    second = {**first, "results": [{"strategy": "auto16", "ms_per_step": 0.9}, {"strategy": "auto24", "ms_per_step": 0.8}]}
    merged = train.merge_into(path, second)
    assert [(r["strategy"], r["ms_per_step"]) for r in merged["results"]] == [
        ("eager_full@16", 2.0), ("auto16", 0.9), ("auto24", 0.8)]
    with pytest.raises(SystemExit, match="another run"):
        train.merge_into(path, {**second, "env": {**env, "commit": "def5678"}})


def test_flux_repro_lists_its_cases_and_needs_cuda():
    from benchmarks import flux_train_repro as repro

    cases = repro._cases(["sdpa", "block", "model"])
    assert ("sdpa", "cudnn+checkpoint") in cases and ("block", "single/no-cudnn") in cases
    assert ("model", "default") in cases and ("model", "default+cap0.9") in cases and len(cases) == 8 + 4 + 3
    assert [v for _, v in repro._cases(["mix"])] == ["blocks/double+single", "sdpa/dense+strided", "sdpa/strided",
                                                     "sdpa/dense"]
    pressure = repro._cases(["pressure"])
    assert [v for _, v in pressure] == [f"backward/leave{n}" for n in repro.PRESSURE_LEAVE_GIB] + ["forward/leave0.25"]
    with pytest.raises(SystemExit):
        repro.main(["--stages", "sdpa,nonsense"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            repro.main(["--stages", "sdpa"])


def test_baselines_are_the_blocks_without_the_plans_kernels():
    # eager_full / regional_full time what a user has without the plan: SDPA's own dispatch
    # and none of the plan's fusions; the plan's rows keep them (the GELU epilogue is applied
    # on CPU too, as its definition).
    base = train.build("wan2.1-tiny", "eager_full", gpu="cpu", device="cpu", backend="eager", optimizer="none")
    plan = train.build("wan2.1-tiny", "save_all", gpu="cpu", device="cpu", backend="eager", optimizer="none")
    assert "GELU in the GEMM epilogue" not in base.report().step("precision").did
    assert "RoPE in one pass" not in base.report().step("precision").did
    assert "GELU in the GEMM epilogue" in plan.report().step("precision").did
