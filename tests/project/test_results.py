"""Results that cannot drift: every table in README.md and docs/*.md is what
`python -m benchmarks.tables` writes from the committed JSON; no measured number is typed
into those docs outside a generated block; every results file names its commit (or is listed
as unknown, and shown so); every path that cites a results file names one that exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import tables
from helpers import REPO, checkout_files

RESULTS = REPO / "benchmarks" / "results"
ALLOWED_FILE = Path(__file__).with_name("prose_numbers_allowed.txt")

# A number with a unit that only a measurement has (any number: "18 FPS" is as measured as
# "18.6 FPS") ...
MEASURED_UNITS = r"ms|s/it|dB|FPS|fps|TFLOP/s|TB/s"
# ... and units that settings and sizes share with measurements, where only a decimal is read
# as measured: "80 GiB card", "a 12 GiB budget", "2× H100", "832x480" and "a 5 s timeout" are
# prose; "43.55 dB", "4.0 s", "1.44×" and "51.7 GiB" are results.
DECIMAL_UNITS = r"s|GiB|GB|×|x"
NUMBER_WITH_UNIT = re.compile(
    rf"(?<![\w.,])(?:\d+(?:,\d{{3}})*(?:\.\d+)?\s?(?:{MEASURED_UNITS})|\d+\.\d+\s?(?:{DECIMAL_UNITS}))(?![\w/])")


def _allowed() -> set[tuple[str, str]]:
    """(file, exact text) pairs from prose_numbers_allowed.txt: `file: text  # why` per line."""
    out = set()
    for line in ALLOWED_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            file, text = (part.strip() for part in line.split(":", 1))
            out.add((file, text))
    return out


def _prose_numbers(text: str) -> list[tuple[int, str]]:
    """(line, match) for every number with a unit outside the generated blocks."""
    outside = tables.MARKER.sub(lambda m: m.group(1) + "\n" * m.group(3).count("\n") + m.group(4), text)
    return [(i, m.group(0)) for i, line in enumerate(outside.splitlines(), 1)
            for m in NUMBER_WITH_UNIT.finditer(line)]


def test_every_marked_table_is_what_the_generator_writes():
    stale = tables.stale_blocks(REPO)
    assert not stale, "tables differ from benchmarks/results (run `python -m benchmarks.tables`): " + ", ".join(stale)


def test_the_generator_fills_the_readme_headline_and_every_table_of_docs_benchmarks():
    readme = (REPO / "README.md").read_text()
    assert "<!-- table:headline -->" in readme
    testing = (REPO / "docs" / "testing.md").read_text()
    assert "<!-- table:gpu-tests -->" in testing  # which commit last ran each GPU test
    guide = (REPO / "docs" / "adding-a-model.md").read_text()
    assert "<!-- table:adapter-sizes -->" in guide  # each family's code and config-table lines
    page = (REPO / "docs" / "benchmarks.md").read_text()
    named = {m.group(2) for m in tables.MARKER.finditer(page)}
    assert named == set(tables.TABLES) - {"headline", "gpu-tests", "adapter-sizes"}, set(tables.TABLES) ^ named


def test_gpu_test_logs_are_summarised_from_pytest_own_line(tmp_path, monkeypatch):
    logs = tmp_path / "gpu_tests"
    logs.mkdir()
    (logs / "gputests_all_0123abc_h100.log").write_text("....\n== 3 passed, 1 skipped, 9 deselected in 12.50s ==\n")
    (logs / "gputests_multi_h100x2.log").write_text("..F\nE  assert 1 == 2\n")  # cut short: no summary
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    rows = tables.gpu_tests(lambda rel: rel).splitlines()[2:]
    assert rows[0].startswith("| all | 0123abc | H100 | 3 passed, 1 skipped, 9 deselected | 12 |"), rows
    assert rows[1].startswith("| multi | not recorded | H100 ×2 | no pytest summary"), rows


def test_whole_generation_joins_the_calls_of_one_commit_and_card(tmp_path, monkeypatch):
    """One measurement spans a file per call (`--label`): a row is compared with the diffusers
    row of the same commit and card that wrote its frames alike, and with nothing else; smoke
    and CPU files are left out, a shorter run's file is named but not shown."""
    folder = tmp_path / "wan2.1-i2v-14b"
    folder.mkdir()
    sha, other = "1" * 40, "2" * 40

    def write(name, rows, commit=sha, card="NVIDIA H200", written=True, **top):
        record = {"complete": True, "model": "wan2.1-i2v-14b-480p", "weights": "random", "smoke": False,
                  "frames_written": written, "cache": "first_block:0.1", "distill_model": "wan2.1-i2v-14b-480p-distill",
                  "environment": {"card": card, "commit": commit, "commit_source": "git"}, **top,
                  "rows": [{"status": "ok", "shape": "480x832x81", "steps": 40, "guidance": 5.0, **r} for r in rows]}
        (folder / f"whole_generation_wan2.1-i2v-14b-480p_{name}.json").write_text(json.dumps(record))

    write("40steps_wgtest-base_h200", [{"row": "diffusers", "whole_s": 300.0, "text_encoder_s": 1.0,
                                        "image_encoder_s": 1.0, "vae_encode_s": 2.0, "denoise_s": 290.0,
                                        "vae_decode_s": 3.0, "write_frames_s": 1.0}])
    write("40steps_wgtest-fp8_h200", [{"row": "fp8", "whole_s": 150.0},
                                      {"row": "fp8_cache", "whole_s": 100.0, "psnr_vs_fp8_db": "inf"},
                                      {"row": "bf16", "status": "error", "error": "RuntimeError: out of memory"}])
    write("40steps_wgtest-old_h200", [{"row": "fp8", "whole_s": 160.0}], commit=other)  # another tree
    write("40steps_wgtest-nowrite_h200", [{"row": "bf16", "whole_s": 190.0}],
          written=False)  # less work than the diffusers row: no ratio
    write("40steps_wgtest-distill_h200", [{"row": "distill", "whole_s": 12.0, "steps": 4, "guidance": 1.0}])
    write("40steps_wgtest-smoke_cpu", [{"row": "fp8", "whole_s": 1.0}], smoke=True, card="cpu")
    write("4steps_wgtest-short_h200", [{"row": "fp8", "whole_s": 15.0, "steps": 4, "shape": "480x832x21"}])
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    tables.load.cache_clear()  # `load` is cached by path under RESULTS, which this test moved
    try:
        text = tables.whole_generation(lambda rel: rel)
    finally:
        tables.load.cache_clear()
    # each line by its first cell (what ran) and its last (the call it is from)
    rows = {(cells[0], cells[-1].rsplit("`", 2)[-2]): line for line in text.splitlines()[2:] if line.startswith("| ")
            for cells in [line.strip("| ").split(" | ")]}
    assert " | 2.00× | " in rows["fp8", "wgtest-fp8"], rows  # 300 s / 150 s, the same tree and card
    assert " | 3.00× | " in rows["fp8 + step cache (`first_block:0.1`), PSNR vs fp8 inf dB", "wgtest-fp8"], rows
    assert " | 1.00× | " in rows["diffusers pipeline, regional compile, FA3 (the baseline)", "wgtest-base"], rows
    assert " | no (`--no-write`) | — | " in rows["bf16", "wgtest-nowrite"], rows
    # another sampler (4 steps, no CFG) than the baseline's: no ratio, though commit and card match
    assert " | yes | — (another sampler) | " in rows["distilled 4-step, fp8 (`wan2.1-i2v-14b-480p-distill`)",
                                                     "wgtest-distill"], rows
    # untimed: the whole call less its phases; none where the record has no phases
    assert " | 300.0 | 2.00 | 2.00 | 290.0 | — | 3.00 | 2.00 | yes | 1.00× | " in rows[
        "diffusers pipeline, regional compile, FA3 (the baseline)", "wgtest-base"], rows
    assert " | 150.0 | — | — | — | — | — | — | yes | " in rows["fp8", "wgtest-fp8"], rows
    assert " | yes | — | " in rows["fp8", "wgtest-old"], rows  # the other commit
    assert len(rows) == 6, rows
    assert "bf16 (H200, `wgtest-fp8`): error: RuntimeError: out of memory" in text
    assert "wgtest-smoke" not in text and "so not shown: `whole_generation_wan2.1-i2v-14b-480p_4steps" in text
    assert "no ratio is drawn across trees or cards" in text


def test_a_stale_or_unknown_table_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "page.md"
    fresh = tables.render("<!-- table:flux-fusions -->\n<!-- /table:flux-fusions -->\n", doc)
    assert "| **magi_zoo, fp8** |" in fresh and "commit aaa18b9b17a6" in fresh
    doc.write_text(fresh.replace("| **magi_zoo, fp8** | 91.7 |", "| **magi_zoo, fp8** | 90.1 |"))  # typed in
    assert tables.stale_blocks(tmp_path) == ["docs/page.md: flux-fusions"]
    doc.write_text(fresh)
    assert tables.stale_blocks(tmp_path) == []
    doc.write_text("<!-- table:nonsense -->\n<!-- /table:nonsense -->\n")
    with pytest.raises(KeyError, match="unknown table 'nonsense'"):
        tables.stale_blocks(tmp_path)


def test_no_measured_number_is_typed_into_readme_or_docs():
    allowed, used, found = _allowed(), set(), []
    for doc in tables.doc_files(REPO):
        rel = doc.relative_to(REPO).as_posix()
        for line, text in _prose_numbers(doc.read_text()):
            if (rel, text) in allowed:
                used.add((rel, text))
            else:
                found.append(f"{rel}:{line}: {text}")
    assert not found, ("numbers with a unit outside a generated block (put the number in a results file and the "
                       "table between <!-- table:NAME --> markers, or, for a setting, add it to "
                       f"{ALLOWED_FILE.name}): " + "; ".join(found))
    assert not allowed - used, f"{ALLOWED_FILE.name} lists numbers no doc has any more: {sorted(allowed - used)}"


def test_the_number_check_reads_results_and_leaves_prose_alone():
    prose = ("a 12 GiB budget on an 80 GiB card, 832x480 frames, 2× H100, a 5 s timeout, 66% attention, "
             "torch 2.11 and Wan2.1-1.3B at 1e-2")
    assert _prose_numbers(prose) == []
    measured = "448.4 ms, 43.55 dB, 4.0 s, 5.06 s/it, 1.44×, 1.2x, 51.7 GiB, 18 FPS, 690 TFLOP/s, 1,917 ms"
    assert [t for _, t in _prose_numbers(measured)] == [
        "448.4 ms", "43.55 dB", "4.0 s", "5.06 s/it", "1.44×", "1.2x", "51.7 GiB", "18 FPS", "690 TFLOP/s", "1,917 ms"]
    block = "<!-- table:flux -->\n| 91.7 ms |\n<!-- /table:flux -->\n448.4 ms\n"
    assert _prose_numbers(block) == [(4, "448.4 ms")]  # inside the block: the generator's


def _commits(record: dict) -> list:
    """Every commit a results record states (its environment; parallel.py's per row)."""
    envs = [record.get("env"), record.get("environment"), *(r.get("env") for r in record.get("rows") or [])]
    found = [e.get("commit") for e in envs if isinstance(e, dict) and "commit" in e]
    return found or [record.get("commit")]


def test_every_result_names_its_commit_or_is_listed_as_unknown():
    """A results file without a real commit (None, 'HEAD', corrected by hand) is listed in
    UNKNOWN_COMMITS, so every table shows it as unknown; GPU test runs (gpu_tests/) are test
    output, whose commit their log names."""
    missing = []
    for path in sorted(RESULTS.rglob("*.json")):
        rel = path.relative_to(RESULTS).as_posix()
        if rel.startswith("gpu_tests/") or rel in tables.UNKNOWN_COMMITS:
            continue
        commits = _commits(json.loads(path.read_text()))
        if not all(isinstance(c, str) and tables.COMMIT.fullmatch(c) for c in commits):
            missing.append(f"{rel}: {commits}")
    assert not missing, missing
    for rel in tables.UNKNOWN_COMMITS:
        assert (RESULTS / rel).is_file(), f"UNKNOWN_COMMITS lists {rel}, which is gone: drop it from the list"
        assert tables.load(rel).commit == "unknown"


def test_a_result_written_by_the_harness_shows_its_commit(tmp_path):
    sha = "9c7ab6b8b11aa32238e53a8d856d77fade2c27c1"
    r = tables.Result("x/r.json", {"env": {"commit": sha, "commit_dirty": True, "commit_source": "git"}})
    assert r.commit == "9c7ab6b8b11a (dirty)"
    given = tables.Result("x/r.json", {"env": {"commit": "9c7ab6b", "commit_dirty": None, "commit_source": "given"}})
    assert given.commit == "9c7ab6b (given)"
    for bad in (None, "HEAD", "abc", "placeholder"):
        assert tables.Result("x/r.json", {"env": {"commit": bad}}).commit == "unknown"


CITED = re.compile(r"benchmarks/results/[\w.+\-/]*[\w+\-]")
CITED_FILES = {".py", ".md", ".toml", ".txt", ".sh", ".cfg"}


def test_every_cited_results_path_exists():
    """Code, specs and docs that cite a results file or folder by path name one that exists
    (moved or deleted results leave no dangling citation). A name followed by a placeholder
    (`<card>`, `*`, `{a,b}`) is a pattern, not a path: not checked."""
    dangling = []
    for path in checkout_files():
        rel = path.relative_to(REPO)
        if path.suffix not in CITED_FILES or rel.as_posix().startswith("benchmarks/results/"):
            continue
        text = path.read_text(errors="replace")
        for m in CITED.finditer(text):
            if text[m.end():m.end() + 1] not in ("<", "*", "{") and not (REPO / m.group(0)).exists():
                dangling.append(f"{rel.as_posix()}: {m.group(0)}")
    assert not dangling, dangling


def test_a_failed_row_is_named_by_its_own_message():
    """The families table names why a row was not measured: the exception's message, also when
    dynamo wrapped it (an error raised inside a compiled region), never the traceback's code."""
    wrapped = ('Unsupported: Observed exception\n  Developer debug context: raised exception '
               'ValueError([ConstantVariable(str: "fp8 attention (fa3) takes no mask")])\n'
               '    raise ValueError("fp8 attention (fa3) takes no mask"')
    assert tables.failure(wrapped) == "fp8 attention (fa3) takes no mask"
    assert tables.failure("RuntimeError: CUDA out of memory\n  File x.py") == "RuntimeError: CUDA out of memory"
    assert tables.failure(None) == "no error recorded"


def test_an_sdpa_only_run_is_same_kernel_only_where_every_magi_zoo_row_ran_the_default_attention():
    def run(*attention):
        rows = [{"strategy": "diffusers_regional", "median_ms": 10.0, "status": "ok"}]
        rows += [{"strategy": f"magi_zoo{i}", "median_ms": 9.0, "status": "ok", **a} for i, a in enumerate(attention)]
        return tables.Result("x.json", {"results": rows}), [r["strategy"] for r in rows]

    r, names = run({"attention": []}, {"attention": []})
    assert "is the same-kernel baseline here" in tables.sdpa_only_note(r, names)
    r, names = run({"attention": []}, {"attention": ["fa3 on blocks (30 attention layers)"]})
    assert "ran other attention kernels (fa3 on blocks (30 attention layers))" in tables.sdpa_only_note(r, names)
    for unknown in (({"attention": []}, {}), ()):  # {}: a record from before the harness wrote `attention`
        r, names = run(*unknown)
        assert "do not say which attention" in tables.sdpa_only_note(r, names)


def test_offload_families_shows_each_rows_planned_copies_and_a_row_that_did_not_finish(tmp_path, monkeypatch):
    """Beside each streamed row, the host-to-card copies its plan makes per forward (the row's
    own plan, or for a row that did not finish the resident process's plan for that budget);
    a row that did not finish is listed with what stopped it, never left out."""
    folder = tmp_path / "offload"
    folder.mkdir()
    env = {"card": "NVIDIA H200", "commit": "1" * 40, "commit_source": "git"}
    resident = {"status": "ok", "model": "m", "strategy": "resident", "budget_gib": None, "median_ms": 200.0,
                "timed_max_reserved_gib": 50.0, "predicted": {"24.0": {"copy_ms": 450.0}}}
    done = {"status": "ok", "model": "m", "strategy": "magi_zoo", "budget_gib": 24, "median_ms": 400.0,
            "timed_max_reserved_gib": 19.0, "plan": {"copy_ms_per_call": {"transformer": 390.0}}}
    cut = {"status": "error", "model": "m", "strategy": "magi_zoo", "budget_gib": 24,
           "error": "timed out after 130 s (its processes killed); last progress: loaded"}
    (folder / "a.json").write_text(json.dumps({"environment": env, "rows": [resident, done]}))
    (folder / "b.json").write_text(json.dumps({"environment": env, "rows": [resident, cut]}))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    monkeypatch.setattr(tables, "OFFLOAD_FAMILIES", {"A": ("offload/a.json",), "B": ("offload/b.json",),
                                                     "C": ("offload/c.json",)})
    tables.load.cache_clear()
    try:
        text = tables.offload_families(lambda rel: rel)
    finally:
        tables.load.cache_clear()
    assert "| m | magi_zoo | 24 | 400.0 | 0.50× | 390.0 | 19.0 | NVIDIA H200 |" in text  # its own plan
    assert "| m | magi_zoo | 24 | error: timed out after 130 s (its processes killed) | — | 450.0 | — |" in text
    assert "| m | resident | — | 200.0 | 1.00× | — | 50.0 |" in text
    assert "Not yet measured under the cap: C." in text
