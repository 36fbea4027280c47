"""The benchmark harness stays alive: the issue's CPU command, run as a user would, and smoke
runs of the families that are no diffusers pipeline (BAGEL's denoise step, Qwen3-Omni's
decode step) through the same adapter entry points."""

import itertools
import json
import os
import subprocess
import sys

import pytest

from helpers.processes import inductor_isa_env


@pytest.mark.slow
def test_harness_cpu_command(tmp_path):
    """The harness as a user runs it: one fresh process per strategy and phase, magi_zoo's warm
    process on empty inductor dirs. Two strategies: each process costs ~10-30 s of imports,
    build and CPU compile on 2 cores (with torch_compile's cold + warm pair the command took
    125 s alone, without it 68 s);
    torch_compile's row is test_harness_torch_compile_row's, its warm-start dirs
    test_warm_processes_keep_torchs_caches_and_empty_magi_zoos'."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "benchmarks.run", "--model", "wan2.1-tiny",
           "--strategies", "eager,magi_zoo", "--device", "cpu", "--out", str(out)]
    # the workers (fresh inductor dirs each) take the vector ISA probed here instead of
    # probing again: ~5 s of g++ for each of the 3 that start on an empty dir
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=dict(os.environ, **inductor_isa_env()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1/2] eager (cold process)" in proc.stdout and "magi_zoo (warm process)" in proc.stdout
    rec = json.loads((out / "wan2.1-tiny_cpu.json").read_text())
    rows = {r["strategy"]: r for r in rec["results"]}
    assert list(rows) == ["eager", "magi_zoo"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rec["flops_per_forward"] > 0 and rec["env"]["torch"] and rec["shape"]["frames"] == 9
    r = rows["magi_zoo"]
    assert r["rel_err_vs_eager"] < 1e-4  # fp32 on CPU
    assert r["first_call_s"] > 0 and r["warm_first_call_s"] > 0
    assert r["runs"] == 5 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    assert r["frames_compiled"] >= 1 and r["recompiles_after_first_call"] == 0
    # the kernel each attention key took, for the tables' same-kernel note ([]: the library's default)
    assert r["attention"] == []
    # magi_zoo's warm process started with empty inductor dirs: only its own artifact
    # cache could have made it a hit
    assert r["warm_cache_status"] == "hit"
    # the results table (the engine's format_table: padded cells; the first table, before
    # magi_zoo's region table) has one "ok" row per strategy
    lines = (out / "wan2.1-tiny_cpu.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows_md = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [(r[header.index("strategy")], r[header.index("status")]) for r in rows_md] == [
        ("eager", "ok"), ("magi_zoo", "ok")]
    assert "magi_zoo regions:" in lines


def test_warm_processes_keep_torchs_caches_and_empty_magi_zoos(tmp_path):
    """The warm-start rule (benchmarks/run.py's docstring): a torch_compile or diffusers warm
    process reuses its cold run's inductor / Triton dirs (torch's own on-disk caches are its warm
    start); each magi_zoo warm process gets empty ones, so only magi_zoo's cache carries code."""
    from benchmarks.run import _strategy_env

    for strategy in ("torch_compile", "diffusers_regional"):
        assert _strategy_env(tmp_path, strategy, "warm", 0) == _strategy_env(tmp_path, strategy, "cold")
    cold = _strategy_env(tmp_path, "magi_zoo", "cold")
    warm = [_strategy_env(tmp_path, "magi_zoo", "warm", k) for k in range(2)]
    dirs = [d for env in (cold, *warm) for d in env.values()]
    assert len(set(dirs)) == len(dirs) == 6  # inductor + Triton, three processes, none shared
    assert set(cold) == {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}


def test_harness_torch_compile_row(tmp_path, monkeypatch):
    """torch_compile's row: the whole denoiser under one torch.compile, counted like magi_zoo's
    (dynamo only: the row's plumbing, not inductor's code, which magi_zoo's rows compile)."""
    rec = _smoke("wan2.1-tiny", tmp_path, monkeypatch, "--strategies", "eager,torch_compile", "--backend", "eager")
    rows = {r["strategy"]: r for r in rec["results"]}
    assert list(rows) == ["eager", "torch_compile"]
    r = rows["torch_compile"]
    assert r["status"] == "ok" and r["rel_err_vs_eager"] < 1e-5, r
    assert r["frames_compiled"] >= 1 and r["recompiles_after_first_call"] == 0 and r["first_call_s"] > 0
    assert "attention" not in r  # no plan, no attention step to report


def test_harness_rejects_unknown_strategy_and_too_few_runs():
    from benchmarks.run import main

    with pytest.raises(SystemExit, match="unknown strategies"):
        main(["--model", "wan2.1-tiny", "--strategies", "eager,turbo", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--runs >= 5"):
        main(["--model", "wan2.1-tiny", "--runs", "3", "--device", "cpu"])


def _smoke(model: str, out, monkeypatch, *extra: str) -> dict:
    """The harness on a tiny variant, as its CPU smoke run: plumbing, not a measurement
    (a cheap backend, no warm-start process, 1 warm-up + 2 timed calls). Its workers run in
    this process, each on an empty dynamo cache as a fresh process starts: what these runs
    check is the entry points, the refusals and the records; the process boundary (fresh
    interpreters, fresh compile caches, a warm start) is test_harness_cpu_command's, and each
    worker launched here cost a fresh import of torch, diffusers and transformers and a build
    (~5 s per worker on 2 cores)."""
    import torch

    from benchmarks import common
    from benchmarks.run import main

    def run_in_process(module, args, *, result_file, **_):
        assert module == "benchmarks.run" and "--worker" in args, args
        torch.compiler.reset()
        try:
            main(args)  # a worker's main records its failure in result_file, as in its own process
        finally:
            torch.compiler.reset()  # and nothing it compiled stays behind, as when its process ends
        return json.loads(result_file.read_text())

    monkeypatch.setattr(common, "run_isolated", run_in_process)
    return main(["--model", model, "--device", "cpu", "--out", str(out), "--no-warm-start", "--smoke",
                 "--warmup", "1", "--runs", "2", *extra])


ENV_FIELDS = {"card", "torch", "triton", "diffusers", "transformers", "commit"}


def test_harness_bagel_denoise_step_with_cfg_on_cpu(tmp_path, monkeypatch):
    """BAGEL's entry point is one denoising step with CFG over three KV contexts (what the
    former benchmarks/bagel_gpu.py measured); diffusers_regional cannot apply to it and is
    refused without starting a process."""
    rec = _smoke("bagel-tiny", tmp_path, monkeypatch, "--entry", "denoise", "--strategies", "eager,diffusers_regional,magi_zoo",
                 "--backend", "eager", "--shape", "text_len=8")
    rows = {r["strategy"]: r for r in rec["results"]}
    assert list(rows) == ["eager", "diffusers_regional", "magi_zoo"]
    assert rows["diffusers_regional"]["status"] == "refused"
    assert "compile_repeated_blocks" in rows["diffusers_regional"]["error"]
    assert "Bagel.forward" in rows["diffusers_regional"]["error"]
    for name in ("eager", "magi_zoo"):
        r = rows[name]
        assert r["status"] == "ok" and "error" not in r, r
        assert r["entry_target"] == "Bagel.forward" and r["runs"] == 2 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    assert rec["entry"] == "denoise" and rec["shape"]["text_len"] == 8 and rec["shape"]["height"] == 64
    assert rec["smoke"] and rec["flops_per_forward"] > 0 and ENV_FIELDS <= set(rec["env"])
    z = rows["magi_zoo"]
    # fp32 on CPU, eager backend: the compiled step is eager's computation
    assert z["rel_err_vs_eager"] < 1e-4 and z["max_abs_diff_vs_eager"] < 1e-3
    assert z["frames_compiled"] >= 1 and z["recompiles_after_first_call"] == 0
    assert sum(r["calls"] for r in z["regions"]) > 0  # the step ran through compiled regions
    assert "tokens_per_s" not in z  # a denoise step is not a decode step
    md = (tmp_path / "bagel-tiny_cpu.md").read_text()
    assert "rel_err_vs_eager" in md and "magi_zoo regions:" in md and "BagelMoTLayer" in md


def test_harness_qwen3_omni_decode_step_on_cpu(tmp_path, monkeypatch):
    """Qwen3-Omni's decode tok/s (what the former benchmarks/qwen3_omni_gpu.py measured) is
    the `decode_step` entry timed per call; `--layers` builds the layer config with fewer
    thinker layers and no talker, and the spec keys for the parts it lacks are dropped."""
    rec = _smoke("qwen3-omni-tiny", tmp_path, monkeypatch, "--entry", "decode_step", "--layers", "1",
                 "--strategies", "eager,diffusers_regional,magi_zoo", "--backend", "aot_eager",
                 "--shape", "ctx_len=16")
    rows = {r["strategy"]: r for r in rec["results"]}
    assert list(rows) == ["eager", "diffusers_regional", "magi_zoo"]
    assert rows["diffusers_regional"]["status"] == "refused"
    assert "decode_step" in rows["diffusers_regional"]["error"]
    for name in ("eager", "magi_zoo"):
        r = rows[name]
        assert r["status"] == "ok" and "error" not in r, r
        assert r["entry_target"] == "Qwen3OmniMoeThinkerTextModel.decode_step"
        assert r["tokens_per_s"] == round(1000 / r["median_ms"], 1)  # one token per call, batch 1
    assert rec["variant"] == "qwen3-omni-tiny-1L" and "1 of 2 thinker layers" in rec["variant_note"]
    assert rec["entry"] == "decode_step" and rec["shape"]["ctx_len"] == 16 and ENV_FIELDS <= set(rec["env"])
    z = rows["magi_zoo"]
    assert z["dropped_keys"] == ["code2wav", "talker.code_predictor.model", "talker.model"]
    assert z["rel_err_vs_eager"] < 1e-4
    # The decode step compiles once (static shapes); later calls on the same cache compile nothing.
    assert z["frames_compiled"] == 1 and z["graph_breaks"] == 0 and z["recompiles_after_first_call"] == 0
    decode = next(r for r in z["regions"] if r["region"].endswith("decode_step"))
    assert decode["calls"] >= 4  # first call + 1 warm-up + 2 timed
    md = (tmp_path / "qwen3-omni-tiny_decode_step_1L_cpu.md").read_text()
    assert "tokens_per_s" in md and "1 of 2 thinker layers" in md


def test_harness_rejects_bad_entry_shape_and_layers(tmp_path):
    from benchmarks.run import main

    base = ["--device", "cpu", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="no entry point 'decode'.*prefill, decode_step"):
        main(["--model", "qwen3-omni-tiny", "--entry", "decode", *base])
    with pytest.raises(SystemExit, match="--layers: .*'wan22'"):
        main(["--model", "wan2.2-tiny", "--layers", "2", *base])
    with pytest.raises(SystemExit, match="--layers 31: .* has 30 transformer.num_layers"):
        main(["--model", "wan2.1-t2v-1.3b", "--layers", "31", *base])
    with pytest.raises(SystemExit, match="has 2 thinker layers"):
        main(["--model", "qwen3-omni-tiny", "--layers", "3", *base])
    with pytest.raises(SystemExit, match="expected key=value"):
        main(["--model", "bagel-tiny", "--shape", "text_len", *base])
    # a shape argument the entry does not take: refused before any process starts
    with pytest.raises(SystemExit, match="example inputs at this shape fail.*seq_len"):
        main(["--model", "qwen3-omni-tiny", "--entry", "decode_step", "--shape", "seq_len=4", *base])


def test_parallel_benchmark_smoke_compares_branches(tmp_path):
    # 2 gloo processes on wan2.1-tiny, one torchrun job per configuration: the CFG step's
    # output and each branch equal one process's (fp32 CPU: exactly), rows written. The blocks
    # run dynamo alone (--backend eager): inductor's CPU code for these blocks is
    # test_harness_cpu_command's and tests/engine/test_parallel's; compiling it in each of the
    # three processes made the command 69 s instead of 45 (alone, 2 cores, empty inductor dir).
    import json

    from benchmarks.parallel import main as parallel_main

    assert parallel_main(["--smoke", "--profile", "--backend", "eager", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "parallel_smoke_cpu.json").read_text())["rows"]
    two = next(r for r in rows if r["gpus"] == 2)
    assert two["config"] == "cfg 2" and two["rel_l2_vs_1gpu"] == 0.0
    assert two["rel_l2_cond_vs_1gpu"] == 0.0 and two["rel_l2_uncond_vs_1gpu"] == 0.0
    # --profile: where rank 0's step went; CFG parallel exchanges the branches (gloo's collective),
    # one process exchanges nothing
    one = next(r for r in rows if r["gpus"] == 1)
    assert two["profile_ms"]["communication"] > 0 and "communication" not in one["profile_ms"], (one, two)
    assert two["profile_ms"]["matmul"] > 0


def test_profile_categories_name_the_kernels():
    from benchmarks.parallel import categorise

    assert categorise("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)") == "communication"
    assert categorise("c10d::allgather_") == "communication"
    assert categorise("void flash::flash_fwd_kernel<...>") == "attention"
    assert categorise("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert categorise("aten::addmm") == "matmul"
    assert categorise("triton_poi_fused_add_mul_0") == "other"


def test_offload_benchmark_smoke_writes_after_every_row(tmp_path, monkeypatch):
    """The offload benchmark (tiny Wan on CPU): every strategy row measured and the results
    written after each row -- a command cut short keeps what it measured -- and a row past
    --row-timeout recorded as an error while the next row still runs."""
    from benchmarks import common, offload

    real = common.run_isolated
    seen = []

    def run_isolated(module, args, **kw):
        # the results file as it stood when this row started: the rows before it, all written
        md = tmp_path / "offload_smoke.md"
        seen.append(md.read_text().count("| wan2.1-tiny ") if md.is_file() else 0)
        if "diffusers" in args:
            kw["timeout"] = 0.001  # this row runs past its limit: its own process, killed
            return real(module, args, **kw)
        # The measured rows run their worker in this process (on an empty dynamo cache, as a
        # fresh process starts): each launch re-imported torch and diffusers and rebuilt the model.
        import torch

        torch.compiler.reset()
        try:
            assert offload.main(args) == 0  # a worker records its failure in its result file
        finally:
            torch.compiler.reset()  # nothing it compiled stays behind, as when its process ends
        return json.loads(kw["result_file"].read_text())

    monkeypatch.setattr(common, "run_isolated", run_isolated)
    assert offload.main(["--smoke", "--out", str(tmp_path), "--row-timeout", "600"]) == 0
    rec = json.loads((tmp_path / "offload_smoke.json").read_text())
    rows = {r["strategy"]: r for r in rec["rows"]}
    assert rows["resident"]["status"] == "ok" and rows["magi_zoo"]["status"] == "ok"
    assert rows["magi_zoo"]["median_ms"] > 0 and rows["magi_zoo"]["speed_vs_resident"] > 0
    assert rows["diffusers"]["status"] == "error" and "timed out" in rows["diffusers"]["error"]
    assert seen == list(range(len(seen)))  # row k started with k rows already in the file


def test_offload_rows_spell_a_budget_one_way(tmp_path, monkeypatch):
    """A case's budgets (ints in GPU_CASES) reach every row as floats: a row whose process never
    reported back records the loop's budget, and the resident row's predictions are keyed by
    str(float) -- an int budget (24) would miss its prediction ('24.0')."""
    from benchmarks import common, offload

    monkeypatch.setattr(offload, "SMOKE_CASES", [("wan2.1-tiny", {}, [1])])
    monkeypatch.setattr(common, "run_isolated", lambda module, args, **kw: {"status": "error", "error": "cut"})
    assert offload.main(["--smoke", "--out", str(tmp_path), "--strategies", "resident,magi_zoo"]) == 0
    rows = json.loads((tmp_path / "offload_smoke.json").read_text())["rows"]
    streamed = next(r for r in rows if r["strategy"] == "magi_zoo")
    assert streamed["status"] == "error" and str(streamed["budget_gib"]) == "1.0"


def test_offload_refuses_to_lose_another_runs_rows(tmp_path, monkeypatch):
    """A command whose results file would replace rows it does not measure again (an fp8 run
    after a bf16 one, same model) is refused before any row runs, naming the rows and the way
    out; the same rows again, or the other rows under --label, are written."""
    from benchmarks import common, offload

    ran = []
    monkeypatch.setattr(common, "run_isolated", lambda module, args, **kw: ran.append(args) or {"status": "error",
                                                                                            "error": "cut"})
    smoke = ["--smoke", "--out", str(tmp_path)]
    assert offload.main([*smoke, "--strategies", "resident,magi_zoo"]) == 0
    assert offload.main([*smoke, "--strategies", "resident,magi_zoo"]) == 0  # the same rows again: fine
    before = len(ran)
    with pytest.raises(SystemExit, match=r"wan2.1-tiny magi_zoo at 0.00025 GiB.*--label"):
        offload.main([*smoke, "--strategies", "resident,magi_zoo_fp8"])
    assert len(ran) == before  # refused before any row ran
    assert offload.main([*smoke, "--strategies", "resident,magi_zoo_fp8", "--label", "fp8"]) == 0
    rows = {r["strategy"] for r in json.loads((tmp_path / "offload_smoke.json").read_text())["rows"]}
    fp8 = {r["strategy"] for r in json.loads((tmp_path / "offload_smoke_fp8.json").read_text())["rows"]}
    assert (rows, fp8) == ({"resident", "magi_zoo"}, {"resident", "magi_zoo_fp8"})


def test_offload_merge_compares_each_row_with_its_own_runs_resident(tmp_path):
    """Split runs merged: a row is compared with the resident row of its own file (two runs'
    resident speeds differ), a file without one with the first file's, a resident row copied
    in by --reference is listed once, and a budget measured twice keeps both rows."""
    from benchmarks import offload

    env = {"card": "NVIDIA H100 80GB HBM3", "commit": "abc"}

    def write(name, rows):
        (tmp_path / name).write_text(json.dumps({"environment": env, "rows": rows}))
        return str(tmp_path / name)

    res_a = {"model": "m", "strategy": "resident", "status": "ok", "median_ms": 100.0}
    res_b = {"model": "m", "strategy": "resident", "status": "ok", "median_ms": 110.0}
    row = lambda b, ms: {"model": "m", "strategy": "magi_zoo", "status": "ok", "budget_gib": b, "median_ms": ms}
    files = [write("a.json", [res_a]), write("b.json", [row(12, 125.0)]),          # no resident: a's
             write("c.json", [res_b, row(16, 110.0)]), write("d.json", [res_a, row(16, 125.0)])]  # d: a --reference copy
    offload.merge(files, tmp_path)
    rows = json.loads((tmp_path / "offload_h100_merged.json").read_text())["rows"]
    assert [r["median_ms"] for r in rows if r["strategy"] == "resident"] == [100.0, 110.0]
    got = {(r["budget_gib"], r["source"]): (r["resident_ms"], r["speed_vs_resident"]) for r in rows if r["strategy"] != "resident"}
    assert got == {(12, "b.json"): (100.0, 0.8), (16, "c.json"): (110.0, 1.0), (16, "d.json"): (100.0, 0.8)}


def test_parallel_benchmark_row_past_its_timeout_is_an_error_row(tmp_path, monkeypatch):
    """A configuration past --timeout: its whole torchrun job is killed (workers too, they
    would hold the GPUs through the next configuration), the row records why, and the
    benchmark still writes its table instead of dying with the timeout."""
    import json
    import tempfile

    from benchmarks.parallel import main as parallel_main

    # The job's temporary files under tmp_path: its workers' command lines name them, so the
    # check below finds this test's workers only (CI runs a second suite beside this one).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert parallel_main(["--smoke", "--out", str(tmp_path), "--timeout", "2"]) == 1  # rows failed: exit 1
    rows = json.loads((tmp_path / "parallel_smoke_cpu.json").read_text())["rows"]
    assert rows and all(r["status"] == "error" and "timed out after 2 s" in r["error"] for r in rows)
    import subprocess

    left = subprocess.run(["pgrep", "-f", f"benchmarks.parallel --worker .*{tmp_path}"], capture_output=True,
                          text=True).stdout
    assert left.strip() == ""  # no worker left behind


def test_flop_count_failure_is_a_missing_column_not_a_failed_row():
    import torch

    from benchmarks.run import count_flops

    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert count_flops(lambda: a @ b) == (2 * 8 * 16 * 4, None)

    def broken():
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    assert count_flops(broken) == (None, "AssertionError: sdpa_flop_count: query/key/value shapes are incompatible")


# -- the commit a result measured -------------------------------------------------------------

def _git(cwd, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(cwd), "PATH": __import__("os").environ["PATH"]}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A small git work tree standing in for the project: one tracked source file and one
    tracked results file; $BENCH_COMMIT unset (and restored, whatever a test sets)."""
    monkeypatch.setenv("BENCH_COMMIT", "")
    root = tmp_path / "tree"
    (root / "benchmarks" / "results").mkdir(parents=True)
    (root / "code.py").write_text("x = 1\n")
    (root / "benchmarks" / "results" / "r.json").write_text("{}\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "first")
    return root


def test_commit_is_read_from_git_with_a_dirty_flag(repo):
    from benchmarks.common import measured_commit

    head = _git(repo, "rev-parse", "HEAD")
    assert measured_commit(root=repo) == {"commit": head, "commit_dirty": False, "commit_source": "git"}
    (repo / "notes.txt").write_text("untracked: not part of what runs\n")
    (repo / "benchmarks" / "results" / "r.json").write_text('{"rewritten": true}\n')  # a result just written
    assert measured_commit(root=repo)["commit_dirty"] is False
    (repo / "code.py").write_text("x = 2\n")  # a tracked file changed: the tree is not HEAD
    assert measured_commit(root=repo) == {"commit": head, "commit_dirty": True, "commit_source": "git"}


def test_a_given_commit_must_agree_with_git(repo, monkeypatch):
    from benchmarks.common import CommitUnknown, measured_commit

    head = _git(repo, "rev-parse", "HEAD")
    assert measured_commit(head[:9], root=repo)["commit"] == head  # git's, in full
    monkeypatch.setenv("BENCH_COMMIT", "0123456789ab")  # a stale value from another run
    with pytest.raises(CommitUnknown, match=f"git says HEAD is {head[:12]}"):
        measured_commit(root=repo)


def test_without_git_a_result_needs_the_commit_given(tmp_path, monkeypatch):
    from benchmarks import common

    monkeypatch.setenv("BENCH_COMMIT", "")
    tree = tmp_path / "copy"  # the tree as it travels to a GPU machine: no .git
    tree.mkdir()
    with pytest.raises(common.CommitUnknown, match="--commit SHA"):
        common.measured_commit(root=tree)
    for bad in ("HEAD", "placeholder", "abc"):
        with pytest.raises(common.CommitUnknown, match="7-40 hex digits"):
            common.measured_commit(bad, root=tree)
    given = {"commit": "9c7ab6b", "commit_dirty": None, "commit_source": "given"}
    assert common.measured_commit("9c7ab6b", root=tree) == given
    # write_results refuses where nothing says the commit: no file is written
    monkeypatch.setattr(common, "ROOT", tree)
    with pytest.raises(common.CommitUnknown):
        common.write_results(tmp_path / "out", "r", {"x": 1}, "# r")
    assert not (tmp_path / "out").exists()
    # --commit on a script's command line: recorded as given, and inherited by the processes it starts
    import argparse

    parser = argparse.ArgumentParser()
    common.add_commit_argument(parser)
    assert parser.parse_args(["--commit", "9c7ab6b8b11a"]).commit == "9c7ab6b8b11a"
    assert __import__("os").environ["BENCH_COMMIT"] == "9c7ab6b8b11a"
    common.write_results(tmp_path / "out", "r", {"env": common.measured_commit()}, "# r")
    assert json.loads((tmp_path / "out" / "r.json").read_text())["env"]["commit_source"] == "given"


def test_a_copy_inside_another_repository_is_not_read_as_that_repository(repo, monkeypatch):
    """A tree without .git placed inside some other work tree: git would answer with the
    outer repository's HEAD, which is not the commit this tree is."""
    from benchmarks.common import CommitUnknown, measured_commit

    inner = repo / "copy_of_the_project"
    inner.mkdir()
    with pytest.raises(CommitUnknown, match="not a git work tree"):
        measured_commit(root=inner)


def test_every_results_writing_script_takes_the_commit_and_none_reads_the_variable_itself():
    from pathlib import Path

    from benchmarks import common

    scripts = sorted(Path(common.ROOT, "benchmarks").glob("*.py"))
    for path in scripts:
        src = path.read_text()
        if path.name == "common.py":
            continue
        assert "BENCH_COMMIT" not in src, f"{path.name}: the commit comes from common.measured_commit"
        if "write_results(" in src or "publish(" in src:
            assert "add_commit_argument" in src or "kernel_bench_start" in src, path.name
            assert "results_dir(" in src or "kernel_bench_start" in src, f"{path.name}: --out is its topic folder"


def test_model_topics_name_the_results_folders():
    from benchmarks.common import RESULTS, model_topic, results_dir

    assert model_topic("wan2.1-i2v-14b-480p") == "wan2.1-i2v-14b" and model_topic("flux.1-dev") == "flux"
    assert model_topic("wan2.1-tiny") == "wan2.1-tiny"
    for model in ("wan2.1-t2v-1.3b", "wan2.1-i2v-14b-480p", "flux.1-dev", "bagel-7b-mot", "qwen3-omni-30b-a3b"):
        assert results_dir(model_topic(model)).is_dir(), model  # where its committed results are
    assert not [p for p in RESULTS.iterdir() if p.is_file()]  # every result lies in a topic folder


def test_layer_derivation_keeps_every_published_constant_but_depth():
    """--layers cuts the denoiser's block stacks (and the encoders, which the timed entry never
    runs) and nothing else: widths, heads, patch sizes stay the published ones."""
    from benchmarks.run import LAYER_VARIANTS
    from magi_zoo import adapters

    adapter, variant = adapters.lookup("flux.1-dev")
    derived, note = LAYER_VARIANTS[adapter.family](variant, 2)
    assert derived.name == "flux.1-dev-2L" and "num_single_layers 2 of 38" in note
    changed = {(c, k) for c, cfg in variant.config.items() if isinstance(cfg, dict)
               for k, v in cfg.items() if derived.config[c][k] != v}
    assert changed == {("transformer", "num_layers"), ("transformer", "num_single_layers"),
                       ("t5", "num_layers"), ("clip", "num_hidden_layers")}
    assert variant.config["transformer"]["num_layers"] == 19  # the registered variant is untouched


def test_same_kernel_baselines_are_refused_with_the_reason_before_any_process(capsys):
    """The diffusers baselines on FA3 / fp8 need CUDA and the kernels; a family with no
    diffusers regional compile cannot have them at all. Both are refusals recorded before any
    worker starts, each naming its reason (a missing baseline row is never a silent gap)."""
    import argparse

    from benchmarks.run import _preflight
    from magi_zoo import adapters

    args = argparse.Namespace(entry="denoise", device="cpu", height=None, width=None, frames=None, shape=[])
    strategies = ["eager", "diffusers_regional", "diffusers_regional_fa3", "diffusers_fp8"]
    refused = _preflight(args, *adapters.lookup("wan2.1-tiny"), strategies)
    assert set(refused) == {"diffusers_regional_fa3", "diffusers_fp8"}
    assert all("needs a CUDA device" in why for why in refused.values()), refused
    refused = _preflight(args, *adapters.lookup("bagel-tiny"), strategies)
    assert set(refused) == {"diffusers_regional", "diffusers_regional_fa3", "diffusers_fp8"}
    assert refused["diffusers_fp8"].startswith("diffusers_fp8 needs a diffusers model's forward"), refused


def test_per_tensor_fp8_baseline_quantizes_with_one_scale_per_tensor():
    import torch

    from benchmarks.baselines import FP8_MAX, _per_tensor_fp8

    x = torch.randn(2, 64, 3, 16) * torch.tensor([1.0, 10.0, 100.0]).view(1, 1, 3, 1)
    q, descale = _per_tensor_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and descale.shape == (2, 3)
    assert torch.all(descale == x.abs().amax() / FP8_MAX)  # one scale, repeated per (batch, head)
    back = q.float() * descale[0, 0]
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative for normal values; the small head
    # (100x below the amax) loses more, which is what per-head scales fix
    big = x[:, :, 2]
    assert float((back[:, :, 2] - big).abs().max() / big.abs().max()) < 2 ** -4


def test_whole_generation_smoke(tmp_path):
    """benchmarks.whole_generation's CPU smoke run: every phase timed, the cached row's
    distance to the uncached one, the diffusers baseline refused with its reason where FA3
    cannot run (the distilled row's sampler: tests/models/wan/test_distill.py)."""
    from benchmarks.whole_generation import main

    assert main(["--smoke", "--rows", "fp8,fp8_cache,diffusers", "--frames", "5", "--out", str(tmp_path)]) == 0
    rec = json.loads(next(tmp_path.glob("whole_generation_wan2.1-tiny_*_cpu.json")).read_text())
    rows = {r["row"]: r for r in rec["rows"]}
    for name in ("fp8", "fp8_cache"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["whole_s"] >= r["denoise_s"] + r["vae_decode_s"] + r["write_frames_s"] > 0
        assert len(r["steps_s"]) == r["steps"] and r["text_encoder_s"] > 0 and r["recompiles"] == 0
    assert rows["fp8"]["steps"] == 2 and rows["fp8"]["guidance"] == 5.0  # the tiny variant's own call
    assert rows["fp8_cache"]["psnr_vs_fp8_db"] is not None and 0 < rows["fp8_cache"]["ssim_vs_fp8"] <= 1
    assert rows["diffusers"]["status"] == "refused" and "needs a CUDA device" in rows["diffusers"]["error"]
    assert rec["complete"] and rec["frames_written"]


def test_whole_generation_label_and_no_write(tmp_path, monkeypatch):
    """`--label` names the file (checked before anything runs); `--no-write` skips the .mp4 and
    the record says so; without an encoder the run is refused before any model is built."""
    from benchmarks import whole_generation

    with pytest.raises(SystemExit, match="letters, digits"):
        whole_generation.main(["--smoke", "--label", "a/b", "--out", str(tmp_path)])
    from magi_zoo.cli import writers

    monkeypatch.setattr(writers, "mp4_writer_missing", lambda: "needs ffmpeg: pip install imageio-ffmpeg")
    with pytest.raises(SystemExit, match="--no-write"):
        whole_generation.main(["--smoke", "--rows", "fp8", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # refused before any row ran or any file was written
    assert whole_generation.main(["--smoke", "--rows", "fp8", "--frames", "5", "--no-write", "--label", "nw",
                                  "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "whole_generation_wan2.1-tiny_2steps_nw_cpu.json").read_text())
    assert rec["frames_written"] is False and rec["complete"]
    assert rec["rows"][0]["status"] == "ok" and rec["rows"][0]["write_frames_s"] is None


def test_layer_configs_for_every_published_variant_of_a_layered_family():
    # `--layers N` / the one-layer encoders on every published variant whose family the harness
    # can cut: a variant without one of its family's encoders (FLUX.2 klein: no vision tower)
    # keeps the rest of the config, the depth keys get N, each encoder present gets one layer.
    from benchmarks.run import DEPTH_KEYS, ENCODER_KEYS, _denoiser_layers
    from magi_zoo import adapters

    seen = set()
    for adapter in adapters.all_adapters():
        for variant in adapter.variants.values():
            if variant.family not in DEPTH_KEYS or variant.name.endswith("tiny"):
                continue
            for n in (1, None):
                derived, note = _denoiser_layers(variant, n)
                assert derived.name.startswith(variant.name) and variant.name in note
                for component, key in ENCODER_KEYS.get(variant.family, ()):
                    if component in variant.config:
                        assert derived.config[component][key] == 1, (variant.name, component)
                if n == 1:
                    assert all(derived.config[c][k] == 1 for c, k in DEPTH_KEYS[variant.family])
            seen.add(variant.name)
    assert {"flux.2-klein-4b", "flux.2-dev", "wan2.1-t2v-1.3b", "flux.1-dev"} <= seen


def test_fp8_sensitivity_smoke_has_a_row_per_group_of_block_linears(tmp_path):
    """CPU, tiny LTX-2 (no fp8 matmuls there: the plumbing only, and the record says so): bf16
    eager, the plan, then the plan with each child of the block that holds linears kept bf16
    through the spec's keep_bf16 (a pattern matching no linear would raise)."""
    from benchmarks.fp8_sensitivity import main

    assert main(["--model", "ltx-2-tiny", "--smoke", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "fp8_sensitivity_ltx-2-tiny_cpu.json").read_text())
    assert rec["groups"] == ["attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn",
                             "video_to_audio_attn", "ff", "audio_ff"]
    rows = [r["row"] for r in rec["rows"]]
    assert rows[:3] == ["bf16 eager", "bf16 (smoke) plan", "bf16 (smoke), attn1 kept bf16"]
    assert len(rows) == 2 + len(rec["groups"]) and "PLUMBING ONLY" in rec["note"]
    assert all(r["distance"] > 0 for r in rec["rows"])


def test_fp8_sensitivity_finds_the_groups_of_path_keyed_regions(tmp_path):
    """Z-Image keys its three block sites by path (no class key names the blocks): the groups
    are read from the blocks the plan's fp8 regions resolve to, every site's, each once, and a
    group is kept bf16 only in the regions whose blocks have it (the context refiner's blocks
    have no modulation linears: keeping `adaLN_modulation.*` there would be refused). With the
    CPU's fp8 numerics, so the keeps are applied and checked."""
    from benchmarks.fp8_sensitivity import main

    with pytest.raises(SystemExit):  # its spec declares no fp8 regions: the keys must be named
        main(["--model", "z-image-tiny", "--cpu-fp8", "--out", str(tmp_path)])
    sites = "transformer.layers.*,transformer.noise_refiner.*,transformer.context_refiner.*"
    assert main(["--model", "z-image-tiny", "--cpu-fp8", "--regions", sites, "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "fp8_sensitivity_z-image-tiny_cpu.json").read_text())
    assert rec["groups"] == ["attention", "feed_forward", "adaLN_modulation"]
    rows = {r["row"]: r["distance"] for r in rec["rows"]}
    assert list(rows)[1:] == ["fp8 plan", "fp8, attention kept bf16", "fp8, feed_forward kept bf16",
                              "fp8, adaLN_modulation kept bf16"]
    # keeping the modulation linears changes the plan: the keep was applied where they exist
    assert rows["fp8, adaLN_modulation kept bf16"] != rows["fp8 plan"]


def test_ltx2_one_layer_gemma_keeps_the_connectors_reading_its_hidden_states():
    """LTX-2's connectors project Gemma's stacked hidden states (one per layer, plus the
    embeddings): cutting Gemma to one layer must narrow their input to match (ENCODER_TIES), or
    the pipeline's own prompt path fails. Checked on the tiny config, through the pipeline's
    encode_prompt and its connectors."""
    import dataclasses

    import torch

    from benchmarks.run import _one_layer_encoders
    from magi_zoo import adapters

    adapter, variant = adapters.lookup("ltx-2-tiny")
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in variant.config.items()}
    _one_layer_encoders("ltx2", config)
    assert config["text_encoder"]["num_hidden_layers"] == 1 and config["connectors"]["text_proj_in_factor"] == 2
    pipe = adapter.build_random(dataclasses.replace(variant, config=config), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        embeds, mask, *_ = pipe.encode_prompt("a cat", do_classifier_free_guidance=False, max_sequence_length=128,
                                              device=torch.device("cpu"))
        video, audio, _ = pipe.connectors(embeds, mask, padding_side="left")
    assert video.shape[0] == audio.shape[0] == 1 and torch.isfinite(video).all()


def test_fp8_sensitivity_on_the_cpu_measures_fp8_and_keeps_the_specs_own_keeps(tmp_path):
    """--cpu-fp8: the fp8 linears run (torch's CPU _scaled_mm), so the plan's distance differs
    from bf16 eager's; every group row keeps the spec's keep_bf16 too, so keeping the group the
    spec already keeps is the plan itself, to the bit."""
    from benchmarks.fp8_sensitivity import main

    assert main(["--model", "ltx-2-tiny", "--cpu-fp8", "--out", str(tmp_path), "--stem", "s"]) == 0
    rec = json.loads((tmp_path / "s.json").read_text())
    rows = {r["row"]: r for r in rec["rows"]}
    assert rec["cpu_fp8"] and "CPU _scaled_mm" in rec["note"]
    assert rec["spec_keep_bf16"] == ["audio_to_video_attn.*", "video_to_audio_attn.*"]
    plan = rows["fp8 plan"]["distance"]
    assert plan != rows["bf16 eager"]["distance"]
    assert rows["fp8, audio_to_video_attn kept bf16"]["distance"] == plan
    assert rows["fp8, ff kept bf16"]["distance"] != plan


def test_fp8_sensitivity_groups_are_checked_before_the_build(tmp_path, monkeypatch):
    """--groups names block children; a wrong one is refused, naming the real ones, before any
    weights are made (the meta device only); a right one limits the rows to it."""
    from benchmarks import fp8_sensitivity, run

    built = []
    real = run._assemble
    monkeypatch.setattr(run, "_assemble", lambda *a, **k: built.append(1) or real(*a, **k))
    with pytest.raises(SystemExit):
        fp8_sensitivity.main(["--model", "ltx-2-tiny", "--smoke", "--groups", "ff,nope", "--out", str(tmp_path)])
    assert built == []
    assert fp8_sensitivity.main(["--model", "ltx-2-tiny", "--smoke", "--groups", "ff", "--out", str(tmp_path),
                                 "--stem", "g"]) == 0
    rows = [r["row"] for r in json.loads((tmp_path / "g.json").read_text())["rows"]]
    assert rows == ["bf16 eager", "bf16 (smoke) plan", "bf16 (smoke), ff kept bf16"]


def test_fp8_checkpoint_harness_measures_the_checkpoints_users_load(tmp_path):
    """benchmarks.fp8_checkpoint's two steps in this process on wan2.1-tiny: both checkpoints
    written from one build, each read back through magi_zoo.load; the fp8 one holds the spec's
    40 block linears as Fp8Linear and fewer transformer bytes (per linear 1 B a weight + 4 B a
    row against 2 B a weight; the tiny's norms and embedders stay), the bf16 one none."""
    from benchmarks import fp8_checkpoint as bench

    written = bench.write("wan2.1-tiny", None, tmp_path)
    assert written["variant"] == "wan2.1-tiny" and written["save_fp8_s"] >= 0
    assert (tmp_path / "fp8" / "magi_zoo_fp8.json").is_file() and not (tmp_path / "bf16" / "magi_zoo_fp8.json").exists()
    bf16, fp8 = (bench.load("wan2.1-tiny", tmp_path / kind) for kind in bench.KINDS)
    assert bf16["fp8_linears"] == 0 and fp8["fp8_linears"] == 40
    assert 0 < fp8["transformer_bytes"] < 0.75 * bf16["transformer_bytes"]
    assert fp8["pipeline_bytes"] - fp8["transformer_bytes"] == bf16["pipeline_bytes"] - bf16["transformer_bytes"]
    assert fp8["load_s"] > 0 and fp8["peak_rss_gib"] >= fp8["rss_before_load_gib"] > 0
    assert bench._ratio({"bf16": bf16, "fp8": fp8}, "transformer_bytes") < 0.75


@pytest.mark.parametrize("layers", [None, "2"], ids=["load", "derived"])
def test_lora_strategy_fuses_a_block_lora_at_load_and_compiles_as_the_base(tmp_path, monkeypatch, layers):
    """magi_zoo_lora: the harness writes a rank-64 LoRA over every linear of the repeated blocks,
    `load(lora=...)` fuses it (through magi_zoo.load, or the derived-variant assembly with
    --layers), and the row compiles the same graphs as magi_zoo with no recompile; the LoRA
    changed the model (its output is not the base's)."""
    pytest.importorskip("peft")
    extra = ["--layers", layers] if layers else []
    rec = _smoke("wan2.1-tiny", tmp_path, monkeypatch, "--strategies", "eager,magi_zoo,magi_zoo_lora",
                 "--backend", "eager", *extra)
    rows = {r["strategy"]: r for r in rec["results"]}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    base, lora = rows["magi_zoo"], rows["magi_zoo_lora"]
    assert "lora" not in base
    # wan2.1-tiny's blocks: attn1 and attn2 (q, k, v, out) + the FFN's two = 10 linears a block
    blocks = int(layers) if layers else 4
    assert lora["lora"] and "fused at load" in lora["lora"][0] and f"{10 * blocks} layers" in lora["lora"][0]
    assert (lora["frames_compiled"], lora["recompiles"]) == (base["frames_compiled"], 0)
    assert lora["recompiles_after_first_call"] == 0
    assert base["rel_err_vs_eager"] < 1e-4 < lora["rel_err_vs_eager"]  # the LoRA changed the weights


def test_block_lora_file_names_every_block_linear_in_the_peft_layout(tmp_path):
    import torch
    from safetensors.torch import load_file

    from benchmarks.common import write_block_lora
    from magi_zoo import adapters

    adapter, variant = adapters.lookup("wan2.1-tiny")
    n = write_block_lora(adapter, variant, tmp_path / "l.safetensors", rank=8)
    state = load_file(str(tmp_path / "l.safetensors"))
    assert n == 40 and len(state) == 80  # 4 blocks x 10 linears, an A and a B each
    a, b = state["transformer.blocks.0.attn1.to_q.lora_A.weight"], state["transformer.blocks.3.ffn.net.2.lora_B.weight"]
    assert a.shape == (8, 32) and b.shape == (32, 8) and a.dtype == torch.bfloat16


def test_profile_forward_profiles_a_baseline_beside_the_shipped_plan(tmp_path):
    """`--baseline` profiles diffusers' own row (no plan applied, its regional compile), the
    default the shipped plan: two records of one model that say which setup they timed."""
    from benchmarks.profile_forward import main

    main(["--smoke", "--out", str(tmp_path), "--runs", "1"])
    main(["--smoke", "--out", str(tmp_path), "--runs", "1", "--baseline", "diffusers_regional"])
    shipped = json.loads((tmp_path / "profile_wan2.1-tiny_bf16_cpu.json").read_text())
    baseline = json.loads((tmp_path / "profile_wan2.1-tiny_diffusers_regional_cpu.json").read_text())
    assert shipped["baseline"] is None and "regional" not in shipped["plan"]
    assert baseline["baseline"] == "diffusers_regional" and "compile_repeated_blocks" in baseline["plan"]
    for rec in (shipped, baseline):  # CPU: aten ops are what is counted
        assert rec["kernels"] and rec["timing"]["median_ms"] > 0
    md = (tmp_path / "profile_wan2.1-tiny_diffusers_regional_cpu.md").read_text()
    assert md.startswith("# Profile: wan2.1-tiny, denoise, baseline diffusers_regional")
    # the baseline is diffusers' setup: the shipped plan's knobs are refused before any build
    with pytest.raises(SystemExit, match="--precision and --overrides"):
        main(["--smoke", "--out", str(tmp_path), "--baseline", "diffusers_regional", "--precision", "fp8"])
    with pytest.raises(SystemExit, match="CUDA device"):  # FA3 rows need Hopper
        main(["--smoke", "--out", str(tmp_path), "--baseline", "diffusers_regional_fa3"])


def test_multikernel_rows_give_the_block_regions_inductors_option_and_keep_their_spec():
    """`magi_zoo[_fp8]_multikernel` / `_persistent`: the one change is `triton.multi_kernel` on the compile
    regions of the repeated blocks (not the text encoder or the VAE); merged into the card's
    section, each region keeps its fullgraph / dynamic, and the option passes the plan's check
    against inductor's config (a misspelt option would raise here)."""
    import magi_zoo
    from benchmarks.run import _zoo_kwargs
    from magi_zoo import adapters
    from magi_zoo.engine import preview
    from magi_zoo.overrides import spec_layers
    from magi_zoo.specs import get_profile

    option = {"options": {"triton.multi_kernel": 1}}
    wan, _ = adapters.lookup("wan2.1-t2v-1.3b")
    assert _zoo_kwargs("magi_zoo_multikernel", wan, "h100") == {
        "overrides": {"compile": {"WanTransformerBlock": option}}}
    flux, _ = adapters.lookup("flux.1-dev")
    assert _zoo_kwargs("magi_zoo_fp8_multikernel", flux, "h100") == {
        "precision": "fp8",
        "overrides": {"compile": {"FluxSingleTransformerBlock": option, "FluxTransformerBlock": option}}}
    persistent = {"options": {"triton.multi_kernel": 2}}  # the persistent kind forced
    assert _zoo_kwargs("magi_zoo_persistent", flux, "h100") == {
        "overrides": {"compile": {"FluxSingleTransformerBlock": persistent, "FluxTransformerBlock": persistent}}}
    # the H100 plan on the tiny Wan (the published one's module tree, four blocks)
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    layers = spec_layers(h.adapter, get_profile("h100"), **_zoo_kwargs("magi_zoo_multikernel", h.adapter, "h100"))
    specs = {(t.key, t.method): t.spec for t in preview(h.modules, layers).targets}
    block = specs[("WanTransformerBlock", "forward")]
    assert (block.fullgraph, block.dynamic, block.options) == (True, False, {"triton.multi_kernel": 1})
    assert all(s.options is None for (key, _), s in specs.items() if key != "WanTransformerBlock")


def test_fa3_row_takes_the_repeated_blocks_where_the_spec_names_no_attention():
    """`magi_zoo_fa3` on a spec without an attention section (Flux.1's on an A100: only its
    Hopper profiles name one) puts FA3 on the regions its precision section names -- the row
    differs from magi_zoo's -- while `magi_zoo_sdpa` there would equal magi_zoo and is refused;
    a spec that names attention keys keeps them (Flux.1's on an H100)."""
    from benchmarks.run import _zoo_kwargs
    from magi_zoo import adapters

    flux, _ = adapters.lookup("flux.1-dev")
    assert _zoo_kwargs("magi_zoo_fa3", flux, "a100") == {
        "overrides": {"attention": {"FluxTransformerBlock": "fa3", "FluxSingleTransformerBlock": "fa3"}}}
    with pytest.raises(TypeError, match="equals magi_zoo"):
        _zoo_kwargs("magi_zoo_sdpa", flux, "a100")
    assert _zoo_kwargs("magi_zoo_sdpa", flux, "h100") == {
        "overrides": {"attention": {"FluxTransformer2DModel": "native"}}}
    ltx, _ = adapters.lookup("ltx-2")
    assert _zoo_kwargs("magi_zoo_sdpa", ltx, "h100") == {
        "overrides": {"attention": {"LTX2VideoTransformer3DModel": "native"}}}
