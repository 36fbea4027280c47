"""The benchmark harness stays alive: the issue's CPU command, run as a user would."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_harness_cpu_command(tmp_path):
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "benchmarks.run", "--model", "wan2.1-tiny",
           "--strategies", "eager,torch_compile,magi_zoo", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1/3] eager (cold process)" in proc.stdout and "magi_zoo (warm process)" in proc.stdout
    rec = json.loads((out / "wan2.1-tiny.json").read_text())
    rows = {r["strategy"]: r for r in rec["results"]}
    assert list(rows) == ["eager", "torch_compile", "magi_zoo"]
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert rec["flops_per_forward"] > 0 and rec["env"]["torch"] and rec["shape"]["frames"] == 9
    for name in ("torch_compile", "magi_zoo"):
        r = rows[name]
        assert r["rel_err_vs_eager"] < 1e-4  # fp32 on CPU
        assert r["first_call_s"] > 0 and r["warm_first_call_s"] > 0
        assert r["runs"] == 5 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["frames_compiled"] >= 1 and r["recompiles_after_first_call"] == 0
    # magi_zoo's warm process started with empty inductor dirs: only its own artifact
    # cache could have made it a hit
    assert rows["magi_zoo"]["warm_cache_status"] == "hit"
    # the markdown table (the engine's format_table: padded cells) has one "ok" row per strategy
    table = [line for line in (out / "wan2.1-tiny.md").read_text().splitlines() if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows_md = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [(r[header.index("strategy")], r[header.index("status")]) for r in rows_md] == [
        ("eager", "ok"), ("torch_compile", "ok"), ("magi_zoo", "ok")]


def test_harness_rejects_unknown_strategy_and_too_few_runs():
    from benchmarks.run import main

    with pytest.raises(SystemExit, match="unknown strategies"):
        main(["--model", "wan2.1-tiny", "--strategies", "eager,turbo", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--runs >= 5"):
        main(["--model", "wan2.1-tiny", "--runs", "3", "--device", "cpu"])
