"""Shared measurement helpers for every benchmark script: timing (CUDA events on GPU),
memory, environment facts, the commit a result measured, subprocess isolation and result
writing. One place, so every table is measured the same way (docs/benchmarks.md: warm-up,
>= 5 timed runs, median) and every result names the commit it measured."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# Where the tree travels without .git (a GPU machine gets a copy of the work tree), the commit
# it is comes from `--commit SHA` or this variable; with .git it only has to agree with git.
COMMIT_ENV = "BENCH_COMMIT"

# A model's results folder: the family or checkpoint it measures (the first prefix that matches);
# any other model (the tiny test models) gets a folder of its own name.
MODEL_TOPICS = (("wan2.1-t2v-1.3b", "wan2.1-t2v-1.3b"), ("wan2.1-i2v-14b", "wan2.1-i2v-14b"),
                ("wan2.2-", "wan2.2"), ("flux", "flux"), ("bagel", "bagel"), ("qwen3-omni", "qwen3-omni"),
                ("self-forcing", "self_forcing"))


def results_dir(topic: str) -> Path:
    """benchmarks/results/<topic>/: a script's default `--out` (one folder per thing measured)."""
    return RESULTS / topic


def model_topic(model: str) -> str:
    """The results topic of a model the harness measures (`wan2.1-i2v-14b-480p` -> wan2.1-i2v-14b)."""
    return next((topic for prefix, topic in MODEL_TOPICS if model.startswith(prefix)), model)


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


class CommitUnknown(SystemExit):
    """A result would not say which commit it measured (no .git and none given), or the commit
    given is not what git says this tree is. A SystemExit: a script stops with its one-line
    message (and exit status 1) before it measures anything."""


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_head(root: Path | None = None) -> tuple[str, bool] | None:
    """(HEAD's full hash, whether tracked files differ from it) where `root` is the top of its
    own git work tree; None where it is not (a copy without .git -- even one that lies inside
    some other repository, whose HEAD would name the wrong project). Results files are left
    out of the dirty check: writing one changes nothing a later measurement runs."""
    root = Path(root or ROOT)
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != root.resolve():
        return None
    sha = (_git(root, "rev-parse", "HEAD") or "").strip()
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".",
                  ":(exclude)benchmarks/results")
    if not sha or status is None:
        return None
    return sha, bool(status.strip())


def measured_commit(given: str | None = None, root: Path | None = None) -> dict[str, Any]:
    """The commit a result measures, as the fields every results file records: `commit`,
    `commit_dirty` (tracked files differed from it; None where git could not say) and
    `commit_source` ("git": read here; "given": `--commit` / $BENCH_COMMIT in a tree
    without .git, recorded as given).

    Read from git whenever the tree is a work tree; a commit given there must be HEAD's (a
    stale $BENCH_COMMIT once named a tree that never ran). Without .git, a commit must be
    given, as 7-40 hex digits: otherwise this raises CommitUnknown before anything is
    measured or written."""
    root = Path(root or ROOT)
    given = (given if given is not None else os.environ.get(COMMIT_ENV, "")).strip() or None
    head = git_head(root)
    if head is not None:
        sha, dirty = head
        if given and not sha.startswith(given.lower()):
            raise CommitUnknown(f"the commit given ({given}) is not this tree's: git says HEAD is {sha[:12]}; "
                                f"drop --commit / ${COMMIT_ENV} here (git is read where the tree has .git)")
        return {"commit": sha, "commit_dirty": dirty, "commit_source": "git"}
    if not given:
        raise CommitUnknown(f"{root} is not a git work tree here (no .git), so its commit cannot be read: give it with "
                            f"--commit SHA (or ${COMMIT_ENV}=SHA); a result without its commit is not written")
    if not re.fullmatch(r"[0-9a-fA-F]{7,40}", given):
        raise CommitUnknown(f"--commit / ${COMMIT_ENV} must be a commit hash (7-40 hex digits), not {given!r}")
    return {"commit": given, "commit_dirty": None, "commit_source": "given"}


class _GivenCommit(argparse.Action):
    """`--commit SHA` sets $BENCH_COMMIT, so the processes a script starts (isolated strategy
    processes, torchrun workers) record the same commit."""

    def __call__(self, parser, namespace, values, option_string=None):
        os.environ[COMMIT_ENV] = values
        setattr(namespace, self.dest, values)


def add_commit_argument(parser: argparse.ArgumentParser) -> None:
    """Every results-writing script's `--commit SHA`: the commit a tree without .git is."""
    parser.add_argument("--commit", action=_GivenCommit, default=None, metavar="SHA",
                        help=f"the commit this tree is, where it has no .git (or ${COMMIT_ENV}); "
                             "with .git the commit is read from git")


def environment(device) -> dict[str, Any]:
    """Card, versions and commit: recorded with every number.

    The machine fingerprint is the engine's (`environment_fields`, the same fields that key
    the compile cache); a benchmark adds only the commit it measured. `device_name` is
    recorded as `card`, the name every results file has used. Raises CommitUnknown where the
    commit cannot be known (see `measured_commit`; every script also checks that at its start)."""
    from magi_zoo.engine.compile.cache import environment_fields

    env = environment_fields(device)
    env["card"] = env.pop("device_name")
    env.update(measured_commit())
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
    commit = str(env.get("commit"))[:12] + (" (dirty)" if env.get("commit_dirty") else "") \
        + (" (given)" if env.get("commit_source") == "given" else "")
    return (f"card: {env.get('card')} | torch {env.get('torch')} | triton {env.get('triton')} | "
            f"diffusers {env.get('diffusers')} | transformers {env.get('transformers')} | commit {commit}")


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
    from magi_zoo.overrides import spec_layers

    return {k for _, layer in spec_layers(adapter, get_profile(gpu)) for k in layer.entries(section)}


def fp8_keys(adapter, gpu: str) -> list[str]:
    """The precision regions the spec declares eligible for fp8 (those naming a matmul; the Wan
    VAE is listed for its fusion only)."""
    from magi_zoo.specs import get_profile
    from magi_zoo.overrides import fp8_region_keys, spec_layers

    return fp8_region_keys(spec_layers(adapter, get_profile(gpu)))


def fusions_off(adapter, gpu: str) -> dict[str, dict[str, bool]]:
    """A precision override turning the plan's kernel fusions (the GELU epilogue, norm + rope,
    the VAE's norm + SiLU) off in every precision region: the model as its own code computes
    it, for baselines and attribution rows."""
    return {k: {"gelu_epilogue": False, "fuse_norm_rope": False, "fuse_norm_act": False}
            for k in spec_keys(adapter, gpu, "precision")}


def write_block_lora(adapter, variant, path: Path, *, rank: int, component: str = "transformer", seed: int = 0,
                     std: float = 0.01) -> int:
    """Write a LoRA for `variant`'s `component`: rank-`rank` A / B matrices (random, N(0, std))
    on every nn.Linear inside its repeated blocks (diffusers' `_repeated_blocks`), in the
    diffusers / peft key layout (``transformer.<path>.lora_A.weight`` (rank, in), ``lora_B``
    (out, rank)) that every diffusers LoRA loader reads as is. The module tree comes from a
    meta-device build (no weights). Returns the number of linears adapted; a component with no
    repeated blocks is an error (there is nothing a block LoRA would name)."""
    import torch
    import torch.nn as nn
    from safetensors.torch import save_file

    meta = adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
    root = adapter.components(meta)[component]
    blocks = set(getattr(root, "_repeated_blocks", ()) or ())
    if not blocks:
        raise ValueError(f"{variant.name}: its {component} declares no _repeated_blocks to write a LoRA over")
    g = torch.Generator().manual_seed(seed)
    prefix = "transformer" if component.startswith("transformer") else component  # diffusers' key prefix
    state: dict[str, torch.Tensor] = {}
    for name, block in root.named_modules():
        if type(block).__name__ not in blocks:
            continue
        for sub, lin in block.named_modules():
            if type(lin) is nn.Linear:
                key = f"{prefix}.{name}.{sub}"
                state[f"{key}.lora_A.weight"] = (torch.randn(rank, lin.in_features, generator=g) * std).bfloat16()
                state[f"{key}.lora_B.weight"] = (torch.randn(lin.out_features, rank, generator=g) * std).bfloat16()
    save_file(state, str(path))
    return len(state) // 2


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
    from magi_zoo.engine import format_table

    def cell(v: Any) -> str:
        return "—" if v is None else str(v).replace("|", "\\|").replace("\n", " ")

    return format_table([{c: cell(r.get(c)) for c in columns} for r in rows], columns)


def write_results(out_dir: Path, stem: str, record: dict[str, Any], markdown: str) -> list[Path]:
    """`stem`.json and `stem`.md in `out_dir`. Refuses (CommitUnknown) where the commit measured
    cannot be known, whatever the script recorded."""
    measured_commit()
    out_dir = Path(out_dir)
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
    """The start every single-kernel benchmark shares: parse `--out` (results folder, default
    benchmarks/results/kernels) and `--commit`, take the CUDA device and describe it. Returns
    (args, device, environment)."""
    import torch

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=results_dir("kernels"))
    add_commit_argument(ap)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    return args, dev, environment(dev)


def kernel_row(run: Callable[[], Any], want: Any, nbytes: int, err_key: str, **labels) -> dict[str, Any]:
    """One row of a single-kernel benchmark: `labels`, then GPU ms from CUDA-graph replays of
    `run` (the host's launch cost not counted), GB/s over `nbytes`, and under `err_key` the worst
    relative error of its output(s) -- a tensor or a tuple of them -- against `want`. A variant
    that fails to compile or run is a row with its error, not a crash. Printed as it lands."""
    import torch
    import triton.testing

    as_tuple = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
    try:
        with torch.no_grad():
            got = run()
            err = max(float(((o.float() - r.float()).norm() / r.float().norm()).item())
                      for o, r in zip(as_tuple(got), as_tuple(want), strict=True))
            ms = triton.testing.do_bench_cudagraph(run, rep=40)
    except Exception as e:
        return {**labels, "median_ms": None, "gb_per_s": None, err_key: f"{type(e).__name__}: {str(e)[:80]}"}
    row = {**labels, "median_ms": round(ms, 4), "gb_per_s": round(nbytes / (ms * 1e-3) / 1e9),
           err_key: float(f"{err:.3g}")}
    print(row, flush=True)
    return row


def write_kernel_rows(args, env: dict[str, Any], rows: list[dict], stem: str, title: str, command: str,
                      columns: list[str]) -> None:
    """A single-kernel benchmark's rows as `<stem>_<card>.json` and `.md` under `--out`."""
    md = (f"# {title}\n\n{env_line(env)}\n\ncommand: `{command}`\n\n" + results_table(rows, columns) + "\n")
    for path in write_results(args.out, f"{stem}_{card_tag(env)}", {"env": env, "rows": rows}, md):
        print("wrote", path)


def upcast(x):
    """`x` with every floating tensor inside (dicts, lists, tuples: Z-Image's per-image latents,
    KV caches, per-block keys) copied to fp32."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.float() if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: upcast(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(upcast(v) for v in x)
    return x


def fp32_forward(module, fn: Callable[[dict[str, Any]], Any], inputs: dict[str, Any]):
    """Run `fn(upcast(inputs))` with `module`'s weights in fp32 and TF32 off, then restore
    every parameter and buffer to its own dtype (mixed-precision modules stay as built).
    The yardstick that says whether a bf16 strategy's error against bf16 eager is eager's
    rounding or the strategy's own."""
    import torch

    dtypes = {id(t): t.dtype for t in [*module.parameters(), *module.buffers()]}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        module.float()
        return fn(upcast(inputs))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for t in [*module.parameters(), *module.buffers()]:
            t.data = t.data.to(dtypes.get(id(t), t.dtype))
