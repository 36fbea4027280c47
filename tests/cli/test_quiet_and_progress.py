"""A normal `magi-zoo run` is quiet and never silent (issue 34): library notices are captured
(counted on one line, printed by --debug), recompile reasons with torch's stack traces are
--debug's, a truncated prompt is one line; and a heartbeat line comes whenever the output was
quiet for the interval inside a named stage (the build, the first call's compiles, a stage
without a bar)."""

from __future__ import annotations

import io
import re
import logging
import threading
import time
import warnings

import pytest

import magi_zoo
from magi_zoo.cli import main
from magi_zoo.cli.notices import capture
from magi_zoo.engine.observe.progress import Heartbeat, current_stage, rename_stage, stage


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_heartbeat_prints_after_each_quiet_interval_inside_a_stage():
    clock, out = FakeClock(), io.StringIO()
    beat = Heartbeat(2.0, clock=clock, out=out)
    assert not beat.tick()  # outside any stage: nothing to name
    with stage("building x", clock=clock):
        clock.t += 1.9
        assert not beat.tick()  # quiet for 1.9 s: not yet
        clock.t += 0.1
        assert beat.tick() and out.getvalue().endswith("  ... building x: 2 s\n")
        beat.wrote("a bar's update\r")  # output resets the wait; an open line gets a newline first
        clock.t += 1.0
        assert not beat.tick()
        clock.t += 1.0
        assert beat.tick() and out.getvalue().endswith("\n\n  ... building x: 4 s\n")
        rename_stage("the talker", clock=clock)  # a stage that moves on restarts its clock
        clock.t += 2.0
        assert beat.tick() and out.getvalue().endswith("  ... the talker: 2 s\n")
    assert current_stage() is None and beat.beats == 3


def test_heartbeat_goes_on_from_the_last_output_before_it():
    """The import ticker's last line is where the run's heartbeat starts counting: no extra
    quiet interval at the hand-over."""
    clock, out = FakeClock(), io.StringIO()
    beat = Heartbeat(2.0, clock=clock, out=out, quiet_since=clock.t - 1.5)
    with stage("loading", clock=clock):
        clock.t += 0.5
        assert beat.tick()  # 2 s after the ticker's line, not 2 s after the heartbeat began


def test_import_ticker_prints_while_the_libraries_load(capsys):
    from magi_zoo.cli.console import ticking

    with ticking("loading torch", interval=0.1):
        time.sleep(0.35)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2 and lines[0] == "  ... loading torch: 0 s", lines


def test_heartbeat_thread_keeps_a_silent_stage_talking(capsys):
    """With the real clock: a 0.6 s silent stage under a 0.1 s heartbeat prints lines spaced
    about 0.1 s apart (at least 3), and the streams are restored afterwards."""
    stamps = []

    class Stamped(io.StringIO):
        def write(self, text):
            stamps.append(time.monotonic())
            return super().write(text)

    before = (__import__("sys").stdout, __import__("sys").stderr)
    with Heartbeat(0.1, out=Stamped()) as beat, stage("compiling"):
        time.sleep(0.6)
    assert beat.beats >= 3, beat.beats
    assert max(b - a for a, b in zip(stamps, stamps[1:])) < 0.5  # never silent for long
    assert (__import__("sys").stdout, __import__("sys").stderr) == before
    assert not any(t.name == "magi-zoo-heartbeat" for t in threading.enumerate())


def test_capture_keeps_library_notices_and_shows_ours(monkeypatch, capfd):
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda m, *a, **k: shown.append(str(m)))
    with capture() as got:
        logging.getLogger("transformers.generation.utils").warning("The following generation flags are not valid")
        logging.getLogger("diffusers.pipelines.flux.pipeline_flux").warning(
            "The following part of your input was truncated because CLIP can only handle sequences up to"
            " 77 tokens: ['corgi corgi corgi']")
        logging.getLogger("diffusers.pipelines.flux.pipeline_flux").warning(
            "The following part of your input was truncated because `max_sequence_length` is set to "
            " 512 tokens: ['corgi']")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("Passing `repetition_penalty` with `inputs_embeds`", UserWarning)  # from here: not ours
            warnings.warn_explicit("could not save the compile cache", RuntimeWarning,
                                   filename=magi_zoo.__file__, lineno=1)  # magi_zoo's own: shown
    err = capfd.readouterr().err
    assert "generation flags" not in err and "truncated" not in err, err
    assert shown == ["could not save the compile cache"]
    assert len(got.notices) == 4 and got.truncations() == {"CLIP": 77, "max_sequence_length": 512}
    assert got.summary().startswith("library notices: 4 kept out of this output (transformers 1, diffusers 2, "
                                    "UserWarning 1)")
    from magi_zoo.cli.notices import _library_handlers

    assert not any(type(f).__name__ == "_Filter" for h in _library_handlers() for f in h.filters)  # removed


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory):
    """One eager qwen3-omni-tiny run with speech, the run whose transformers warnings (generation
    flags, repetition_penalty) reached the terminal; output captured at the fd level."""
    out = tmp_path_factory.mktemp("qwen")
    return out, ["run", "qwen3-omni-tiny", "--gpu", "cpu", "--no-compile", "--prompt", "hi", "--max-new-tokens", "2",
                 "--out", str(out / "a.txt"), "--audio-out", str(out / "a.wav")]


def test_a_normal_run_prints_no_library_warning(qwen_run, capfd):
    _, argv = qwen_run
    assert main(argv) == 0
    out, err = capfd.readouterr()
    text = out + err
    assert "wrote" in text
    for noise in ("generation flags", "repetition_penalty", "UserWarning:", "warnings.warn", "Traceback"):
        assert noise not in text, text[-3000:]
    assert "library notices: " in text and "--debug prints them" in text


def test_recompile_reasons_are_debugs_and_a_long_build_shows_heartbeats(tmp_path, monkeypatch, capsys):
    """A report's recompile reasons (torch's ~20-line "User stack trace" blocks) are one
    counting line in a normal run, in full with --debug. The build is a named stage: one that
    takes 2.5 s prints a heartbeat line after 1.25 s (the CLI's interval) naming it. A
    warm-start entry of the compile cache, when used, is one line."""
    from magi_zoo import zoo
    from magi_zoo.engine.observe.report import Report

    monkeypatch.setattr(Report, "details", lambda self: "blocks: recompile: guard failed\nUser stack trace:\n  File x")
    real = zoo.load

    def slow_load(*a, **k):
        time.sleep(2.5)
        return real(*a, **k)

    monkeypatch.setattr(zoo, "load", slow_load)
    argv = ["run", "wan2.1-tiny", "--gpu", "cpu", "--compile", "WanTransformerBlock=false",  # a report, nothing traced
            "--prompt", "p", "--out", str(tmp_path / "a.mp4"), "--steps", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "building wan2.1-tiny ..." in captured.out
    assert re.search(r"  \.\.\. building wan2\.1-tiny: [12] s", captured.err), captured.err
    assert "User stack trace" not in captured.out and "--debug prints the reasons" in captured.out, captured.out
    monkeypatch.setattr(zoo, "load", real)
    # with a warm-start entry (the cache's load reports a hit): one line says it is used
    from magi_zoo.engine.compile import CompileCache

    monkeypatch.setattr(CompileCache, "load", lambda self: setattr(self, "status", "hit") or True)
    assert main([*argv, "--overwrite", "--debug", "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "User stack trace" in out
    assert [x for x in out.splitlines() if x.startswith("warm start: compile cache entry ")] != [], out


def test_a_long_prompt_is_one_line(tmp_path, capfd):
    """A 20k-character prompt on flux-tiny: one line says it was truncated (diffusers echoed
    every dropped token: ~200 KB for 100k characters)."""
    prompt = "a corgi " * 2500
    assert main(["run", "flux-tiny", "--gpu", "cpu", "--no-compile", "--prompt", prompt, "--steps", "1",
                 "--out", str(tmp_path / "a.png")]) == 0
    out, err = capfd.readouterr()
    lines = [x for x in (out + err).splitlines() if "truncated" in x]
    assert lines == [f"prompt truncated: {len(prompt)} characters; the text encoders read at most 77 tokens (CLIP), "
                     "16 tokens (max_sequence_length)"], lines  # the tiny variant's T5 budget
    assert len(out + err) < 20_000, len(out + err)


@pytest.mark.parametrize("model, out, encoder, limit", [
    ("wan2.1-tiny", "a.mp4", "UMT5EncoderModel", 16), ("ltx-2-tiny", "a.gif", "Gemma3ForConditionalGeneration", 128)])
def test_a_silently_truncated_prompt_is_one_line_too(model, out, encoder, limit, tmp_path, capfd):
    """Wan's and LTX-2's pipelines truncate the prompt without a word: the adapter counts the
    tokens (`prompt_caps`) and the run says so in the same one line; a short prompt says nothing."""
    prompt = "a corgi surfing " * 400
    argv = ["run", model, "--gpu", "cpu", "--no-compile", "--steps", "1", "--out", str(tmp_path / out)]
    assert main([*argv, "--prompt", prompt]) == 0
    got = capfd.readouterr()
    lines = [x for x in (got.out + got.err).splitlines() if x.startswith("prompt truncated")]
    assert lines == [f"prompt truncated: {len(prompt)} characters; the text encoders read at most {limit} tokens "
                     f"({encoder})"], lines
    assert main([*argv, "--prompt", "a corgi", "--overwrite"]) == 0
    got = capfd.readouterr()
    assert "prompt truncated" not in got.out + got.err
