"""Running a test script in a fresh Python process (the warm-start tests: a process that
compiled, then one that must not), with extra environment variables."""

from __future__ import annotations

import os
import subprocess
import sys


def run_script(script: str, *args: str, timeout: int = 600, **env: str) -> str:
    """The script's stdout; fails the test with the end of its stderr if it exits non-zero."""
    out = subprocess.run([sys.executable, "-c", script, *args], env=dict(os.environ, **env),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
