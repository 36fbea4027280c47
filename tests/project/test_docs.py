"""The docs stand alone and stay true: a short README whose install and test commands come
first, links that resolve, command names the CLI really has, no file naming a path outside
the repository, and the README's CPU examples run as written.

Markers the README uses (besides `.ci/run`'s `<!-- ci:install -->` / `<!-- ci:test -->`):
`<!-- cpu-example -->` right above a python block means "runs as written on a CPU machine"
(this file runs it); every other python block starts with a `# GPU` comment.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, checkout_files

README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 300
FIRST_LINES = 60  # install, main and test commands must be this close to the top
CPU_MARK = "<!-- cpu-example -->"
# Files outside the repository that once were cited; spelled in parts so this file does not
# cite them either.
FOREIGN_FILES = ("DESIGN" + ".md", "prelude" + ".sh")
AUTHORED_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".ini", ".sh", ".txt", ".yml", ".yaml"}

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:^|[\s(])magi-zoo[ \t]+([a-z][\w-]*)", re.M)
PARENT_PATH = re.compile(r"[\w.\-/]*\.\./[\w.\-/]*")


def _markdown_files() -> list[Path]:
    return [README, REPO / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary (charts) or unreadable: nothing to cite in


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    body = FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", body, re.M)}


def _python_blocks(text: str) -> list[tuple[str, bool]]:
    """(code, marked as a CPU example) for every python block of a markdown text."""
    blocks = []
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        before = text[: m.start()].rstrip().splitlines()
        blocks.append((m.group(2), bool(before) and before[-1].strip() == CPU_MARK))
    return blocks


def _code_text(text: str) -> str:
    """What a markdown text shows as code: fenced blocks and inline code spans."""
    return "\n".join([m.group(2) for m in FENCE.finditer(text)]
                     + [m.group(1) for m in INLINE_CODE.finditer(FENCE.sub("", text))])


def _ci_command(lines: list[str], marker: str) -> tuple[int, int, str]:
    """(marker line, command line, command) of a `<!-- ci:... -->` block, 1-based, read as
    `.ci/run` reads it: the first non-empty line of the code block after the marker."""
    start = next(i for i, line in enumerate(lines) if marker in line)
    fence = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    cmd = next(i for i in range(fence + 1, len(lines)) if lines[i].strip())
    return start + 1, cmd + 1, lines[cmd].strip()


# -- the README ----------------------------------------------------------------------------------
def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; keep it <= {MAX_README_LINES} (details go to docs/)"


def test_install_main_and_test_commands_come_first():
    lines = README.read_text().splitlines()
    _, install_line, install = _ci_command(lines, "<!-- ci:install -->")
    _, test_line, test = _ci_command(lines, "<!-- ci:test -->")
    assert install.startswith("pip install") and install_line <= FIRST_LINES, (install_line, install)
    assert "pytest" in test and test_line <= FIRST_LINES, (test_line, test)
    head = "\n".join(lines[:FIRST_LINES])
    for command in ("magi-zoo demo", "magi-zoo run"):
        assert command in head, f"{command!r} is not in the README's first {FIRST_LINES} lines"


def test_readme_keeps_the_generated_headline_block():
    lines = [line.strip() for line in README.read_text().splitlines()]
    assert "<!-- table:headline -->" in lines and "<!-- /table:headline -->" in lines


def test_readme_python_blocks_are_cpu_examples_or_marked_gpu():
    blocks = _python_blocks(README.read_text())
    assert any(cpu for _, cpu in blocks), "the README has no CPU example"
    for code, cpu in blocks:
        compile(code, "README.md", "exec")  # every block at least parses
        first = code.lstrip().splitlines()[0]
        assert cpu or first.startswith("# GPU"), f"a README python block is neither {CPU_MARK} nor '# GPU': {first!r}"


def test_docs_python_blocks_parse():
    for path in sorted(DOCS.glob("*.md")):
        for code, _ in _python_blocks(path.read_text()):
            compile(code, str(path.relative_to(REPO)), "exec")


@pytest.mark.slow
def test_readme_cpu_examples_run_as_written(tmp_path):
    """The README's CPU examples, in order, in a fresh process on CPU (the quickstart compiles
    wan2.1-tiny's blocks with inductor: tens of seconds on 2 cores)."""
    code = "\n".join(code for code, cpu in _python_blocks(README.read_text()) if cpu)
    script = tmp_path / "readme_examples.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The quickstart printed the report: its step list and a compiled region table.
    assert "apply steps (gpu profile cpu)" in done.stdout and "WanTransformerBlock" in done.stdout


# -- links, commands, citations --------------------------------------------------------------------
def test_relative_links_resolve():
    bad = []
    for path in _markdown_files():
        for target in LINK.findall(path.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(REPO)}: ({target})"
            if not dest.is_relative_to(REPO):
                bad.append(f"{where} points outside the repository")
            elif not dest.exists():
                bad.append(f"{where} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{where}: no heading '#{anchor}' in {dest.relative_to(REPO)}")
    assert bad == []


def _subcommands() -> set[str]:
    from magi_zoo.cli import build_parser

    parser = build_parser()
    return {name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


def test_named_commands_exist():
    real = _subcommands()
    assert {"list", "spec", "demo", "run", "explain"} <= real
    bad = []
    for path in _markdown_files():
        for name in COMMAND.findall(_code_text(path.read_text())):
            if name not in real:
                bad.append(f"{path.relative_to(REPO)}: magi-zoo {name}")
    assert bad == [], f"not subcommands of magi-zoo ({', '.join(sorted(real))}): {bad}"


def test_no_file_cites_anything_outside_the_repository():
    """The design is in docs/; nothing may send a reader to a file a clone does not have."""
    bad = []
    for path in checkout_files():
        text = _text(path)
        if text is None:
            continue
        rel = path.relative_to(REPO)
        for name in FOREIGN_FILES:
            if name in text:
                bad.append(f"{rel}: names {name}")
        if path.suffix in AUTHORED_SUFFIXES or rel.as_posix() == ".ci/run":
            for token in PARENT_PATH.findall(text):
                if not (path.parent / token).resolve().is_relative_to(REPO):
                    bad.append(f"{rel}: {token} is outside the repository")
    assert bad == []


def test_the_checks_catch_what_they_guard():
    """The helpers above see what they must: a link's anchor, a command in code, a CPU mark."""
    assert _slug("The engine's steps, in order") == "the-engines-steps-in-order"
    assert _slug("`magi-zoo spec MODEL`") == "magi-zoo-spec-model"
    assert _slug("step_cache") == "step_cache"
    text = f"x\n\n{CPU_MARK}\n```python\nprint(1)\n```\n\n```python\n# GPU: x\n```\n"
    assert _python_blocks(text) == [("print(1)\n", True), ("# GPU: x\n", False)]
    assert COMMAND.findall(_code_text("run `magi-zoo frobnicate X` and magi-zoo is fine")) == ["frobnicate"]
    outside = PARENT_PATH.findall("see " + "../" * 4 + "elsewhere/x.md")[0]
    assert not (REPO / "docs" / outside).resolve().is_relative_to(REPO)
