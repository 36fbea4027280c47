"""Helpers shared by the test areas (imported as `helpers.<module>`; the root conftest puts
`tests/` on `sys.path`). `TESTS` is the tests folder, `DATA` its recorded reference data,
`REPO` the repository root."""

import subprocess
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "data"
REPO = TESTS.parent
HELPERS = TESTS / "helpers"


def checkout_files() -> list[Path]:
    """Every file of the checkout, tracked or new but not ignored (no venvs, egg-info or
    caches); where the tree travels without .git, the tree walked with those left out."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
        files = [REPO / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):  # a tree that travels without .git
        skip = {".git", "__pycache__", ".pytest_cache", "venv", ".venv", "build", "dist"}
        files = [p for p in REPO.rglob("*") if not set(p.relative_to(REPO).parts) & skip
                 and not any(part.endswith(".egg-info") for part in p.parts)]
    return [p for p in files if p.is_file()]


def flux2_klein_tiny():
    """(the FLUX.2 adapter, a FLUX.2 [klein] base variant at the tiny sizes): `config.TINY_KLEIN`,
    not registered (the conformance suite would compile flux.2-tiny's blocks once more)."""
    from magi_zoo.adapters import lookup
    from magi_zoo.adapters.base import Variant
    from magi_zoo.adapters.flux2 import config

    adapter, _ = lookup("flux.2-tiny")
    return adapter, Variant(name="flux.2-klein-tiny", family="flux2", config=config.TINY_KLEIN, tiny=True,
                            call_defaults=config.TINY_KLEIN_CALL)
