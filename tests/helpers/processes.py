"""Running a test script in a fresh Python process (the warm-start tests: a process that
compiled, then one that must not), with extra environment variables; and the vector ISA
inductor found here, handed to such a process (`inductor_isa_env`)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys


def run_script(script: str, *args: str, timeout: int = 600, **env: str) -> str:
    """The script's stdout; fails the test with the end of its stderr if it exits non-zero."""
    out = subprocess.run([sys.executable, "-c", script, *args], env=dict(os.environ, **env),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def inductor_isa_env() -> dict[str, str]:
    """`TORCHINDUCTOR_VEC_ISA_OK=1` for a child process with its own, empty inductor cache
    dir, where this process's probe found every vector ISA the CPU lists buildable; else {}.

    Inductor on CPU picks its vector ISA (AVX2, AVX-512...) by compiling and loading a small
    C++ file per candidate the CPU lists, and keeps the result in its cache dir: a child with
    an empty one repeats it, about 5 s of g++ per process on a 2-core machine (a third of a
    toy compile's process). With the variable set inductor takes every listed candidate
    unprobed -- the same choice, when the probe here passed them all. Where it did not (or
    this torch's probe is laid out otherwise), nothing is handed over and the child probes."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return {}
    try:
        from torch._inductor import cpu_vec_isa as isa  # lazy: only where a child compiles

        flags = isa.x86_isa_checker()
        listed = [str(i) for i in isa.supported_vec_isa_list if all(f in flags for f in str(i).split())]
        probed = [str(i) for i in isa.valid_vec_isa_list()]  # compiled and loaded here (cached per process)
    except (ImportError, AttributeError):
        return {}
    return {"TORCHINDUCTOR_VEC_ISA_OK": "1"} if listed and probed == listed else {}
