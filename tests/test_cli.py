"""The `magi-zoo` command line, run as a user would (subprocesses for the long ones)."""

import subprocess
import sys

import pytest

from magi_zoo.cli import main


def test_list(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "wan2.1-tiny" in out and "wan2.1, wan" in out


def test_spec_table_at_published_size(capsys):
    # resolved against the real 30-block module tree (built on the meta device)
    assert main(["spec", "wan2.1", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "30 x WanTransformerBlock" in out and "dynamic=False, fullgraph=True" in out
    assert "gpu > model default" in out and "disabled" in out


def test_unknown_model_is_one_clear_line(capsys):
    assert main(["spec", "wan3", "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("magi-zoo: error: unknown model 'wan3'") and "Did you mean" in err


def test_run_writes_mp4(tmp_path):
    out = tmp_path / "corgi.mp4"
    proc = subprocess.run(
        [sys.executable, "-m", "magi_zoo.cli", "run", "wan2.1-tiny", "--prompt", "a corgi surfing",
         "--out", str(out), "--gpu", "cpu", "--steps", "2", "--frames", "5"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.stat().st_size > 0 and out.read_bytes()[4:8] == b"ftyp"  # an MP4 container
    assert "WanTransformerBlock" in proc.stdout  # the report is printed after the run


@pytest.mark.slow
def test_demo_end_to_end():
    proc = subprocess.run([sys.executable, "-m", "magi_zoo.cli", "demo"], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for needle in ("[1/4]", "[4/4]", "WanTransformerBlock", "s/step (median)", "max |eager - compiled|"):
        assert needle in out
    diff = float(out.rsplit("output pixels:", 1)[1].split()[0])
    assert diff < 1e-4  # compiled equals eager on the demo's own output
