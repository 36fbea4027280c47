"""Shared measurement helpers for every benchmark script: timing (CUDA events on GPU),
memory, environment facts, subprocess isolation and result writing. One place, so every
table is measured the same way (DESIGN.md §5: warm-up, >= 5 timed runs, median)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent


def sync(device) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def time_calls(fn: Callable[[], Any], device, *, warmup: int = 2, runs: int = 5) -> dict[str, Any]:
    """Warm-up, then `runs` timed calls: CUDA events on GPU, perf_counter on CPU (ms)."""
    import torch

    is_cuda = getattr(device, "type", device) == "cuda"
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(runs):
        if is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3),
            "max_ms": round(max(times), 3), "runs": runs, "warmup": warmup,
            "times_ms": [round(t, 3) for t in times]}


def first_call(fn: Callable[[], Any], device) -> tuple[Any, float]:
    """(result, wall seconds) of one call, synchronised: the cold/warm first-call time."""
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def gib(nbytes: int | float | None) -> float | None:
    return None if nbytes is None else round(nbytes / 2**30, 3)


def git_commit() -> str | None:
    """The commit measured; $BENCH_COMMIT names it where the tree travels without .git."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             timeout=10, cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=ROOT).stdout.strip()
        return (out + ("+dirty" if dirty else "")) or None
    except Exception:
        return None


def environment(device) -> dict[str, Any]:
    """Card, versions and commit: recorded with every number.

    The machine fingerprint is the engine's (`environment_fields`, the same fields that key
    the compile cache); a benchmark adds only the commit it measured. `device_name` is
    recorded as `card`, the name every results file has used."""
    from magi_zoo.engine.cache import environment_fields

    env = environment_fields(device)
    env["card"] = env.pop("device_name")
    env["commit"] = git_commit()
    return env


CARD_TAGS = ("h100", "h200", "a100", "l40s", "4090", "5090")  # the GPU profiles' cards


def card_tag(env: dict[str, Any], cuda: bool = True) -> str:
    """The short card name every results file is named by: the profile's card ("NVIDIA H100
    80GB HBM3" -> h100), else the model word of the name ("NVIDIA A10G" -> a10g), "gpu"
    without a name; "cpu" off CUDA."""
    if not cuda:
        return "cpu"
    card = str(env.get("card") or "").lower()
    for tag in CARD_TAGS:
        if tag in card:
            return tag
    words = card.replace("nvidia ", "").split()
    return "".join(c for c in words[0] if c.isalnum()) if words else "gpu"


def env_line(env: dict[str, Any]) -> str:
    """The one-line environment header every results table starts with."""
    return (f"card: {env.get('card')} | torch {env.get('torch')} | triton {env.get('triton')} | "
            f"diffusers {env.get('diffusers')} | transformers {env.get('transformers')} | commit {env.get('commit')}")


def matmul_peak_tflops(device, dtype) -> float:
    """Measured dense matmul rate on this card (the ceiling a %-of-peak is taken against)."""
    import torch

    n = 8192 if getattr(device, "type", device) == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_calls(lambda: a @ b, device, warmup=3, runs=10)
    return round(2 * n**3 / (t["median_ms"] / 1e3) / 1e12, 2)


def spec_keys(adapter, gpu: str, section: str) -> set[str]:
    """The keys the model's spec (every layer for this card) names in `section`."""
    from magi_zoo.specs import get_profile
    from magi_zoo.zoo import spec_layers

    return {k for _, layer in spec_layers(adapter, get_profile(gpu)) for k in layer.entries(section)}


def use_expandable_segments() -> None:
    """PYTORCH_CUDA_ALLOC_CONF gains expandable_segments:True (kept if already set there):
    read when CUDA's allocator starts, so call before any CUDA work; child processes inherit it."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(x for x in (conf, "expandable_segments:True") if x)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants. They are found through /proc's parent links,
    not the process group: torchrun starts its workers in sessions of their own, so a group
    kill leaves them running, holding the GPUs and the output pipe. Elsewhere (no /proc) the
    process's group is killed."""
    import signal

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:  # parents first: a killed parent starts no new child
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def run_isolated(module: str, args: list[str], *, env: dict[str, str] | None = None, timeout: float = 900,
                 result_file: Path, echo_prefix: str = "  ") -> dict[str, Any]:
    """Run `python -m module args` in a fresh interpreter, streaming its output (progress),
    and return the JSON it wrote to `result_file` -- or an error record. The timeout holds
    whether or not the child prints (a reader thread streams; the wait has the deadline);
    a child past it is killed, with its process group (its own workers too)."""
    import threading

    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env["PYTHONUNBUFFERED"] = "1"
    tail: list[str] = []

    def stream(pipe) -> None:  # compile progress stays visible
        for line in pipe:
            tail.append(line)
            del tail[:-60]
            if line.startswith("[bench]"):
                print(echo_prefix + line.rstrip(), flush=True)

    try:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=full_env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        reader = threading.Thread(target=stream, args=(proc.stdout,), daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException as e:  # past the deadline, or the parent interrupted: no orphan left
            kill_tree(proc.pid)
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            last = [x.strip() for x in tail if x.startswith("[bench]")][-2:]  # where it was when cut
            return {"status": "error", "error": f"timed out after {timeout:g} s (its processes killed)"
                    + (f"; last progress: {' / '.join(last)}" if last else "")}
        reader.join(timeout=10)
    except Exception as e:
        return {"status": "error", "error": f"{type(e).__name__}: {e}"}
    if result_file.is_file():
        return json.loads(result_file.read_text())
    return {"status": "error", "error": f"exit {rc}: " + "".join(tail)[-3000:]}


def results_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """`columns` of `rows` as the engine's table (markdown-compatible); a value that was not
    measured (missing or None) shows as "—", and a cell's `|` or line break (error messages)
    is escaped so it cannot split the row."""
    from magi_zoo.engine.report import format_table

    def cell(v: Any) -> str:
        return "—" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

    return format_table([{c: cell(r.get(c)) for c in columns} for r in rows], columns)


def write_results(out_dir: Path, stem: str, record: dict[str, Any], markdown: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    j, m = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    j.write_text(json.dumps(record, indent=2, default=str) + "\n")
    m.write_text(markdown + "\n")
    return [j, m]


def publish(out_dir: Path, stem: str, record: dict[str, Any], markdown: str) -> list[Path]:
    """`write_results`, then say where ("[bench] wrote PATH") and print the table."""
    paths = write_results(out_dir, stem, record, markdown)
    for path in paths:
        print(f"[bench] wrote {path}", flush=True)
    print(markdown)
    return paths


def kernel_bench_start(doc: str, argv=None):
    """The start every single-kernel benchmark shares: parse `--out` (results folder), take the
    CUDA device and describe it. Returns (args, device, environment)."""
    import argparse

    import torch

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    return args, dev, environment(dev)


def fp32_forward(module, fn: Callable[[dict[str, Any]], Any], inputs: dict[str, Any]):
    """Run `fn(upcast_inputs)` with `module`'s weights in fp32 and TF32 off, then restore
    every parameter and buffer to its own dtype (mixed-precision modules stay as built).
    The yardstick that says whether a bf16 strategy's error against bf16 eager is eager's
    rounding or the strategy's own."""
    import torch

    dtypes = {id(t): t.dtype for t in [*module.parameters(), *module.buffers()]}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        module.float()
        up = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
        return fn(up)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for t in [*module.parameters(), *module.buffers()]:
            t.data = t.data.to(dtypes.get(id(t), t.dtype))
