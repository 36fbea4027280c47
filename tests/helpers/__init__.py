"""Helpers shared by the test areas (imported as `helpers.<module>`; the root conftest puts
`tests/` on `sys.path`). `TESTS` is the tests folder, `DATA` its recorded reference data,
`REPO` the repository root."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "data"
REPO = TESTS.parent
HELPERS = TESTS / "helpers"
