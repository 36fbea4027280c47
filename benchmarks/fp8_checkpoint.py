"""Host memory and load time of an fp8 checkpoint beside the bf16 checkpoint it was written from.

    python -m benchmarks.fp8_checkpoint --model wan2.1-i2v-14b-480p --layers 8 --out OUT

Each step runs in a fresh process, so each peak is its own:

1. write: the model at its published config (`--layers N`: N of its blocks and one-layer text
   encoders, derived as `benchmarks.run --layers` derives it; widths unchanged), random
   weights in bf16 on the CPU, saved twice with `save_pretrained` -- as held (bf16) and with
   ``precision="fp8"`` (the spec's fp8 regions' linears quantized, `magi_zoo/checkpoints.py`);
2. load, once per directory: ``magi_zoo.load(model, weights=DIR, gpu="cpu", dtype="bfloat16",
   compile=False)`` -- the loading code users run -- timed (wall seconds), then every weight
   read once (`_touch`: a loader may map the files and read nothing yet), timed apart; the
   process's peak resident memory (``ru_maxrss``: what the host had to hold at once, the
   loader's copies included) and the bytes the loaded transformer and whole pipeline hold.
   The files were just written, so both loads read them from the page cache: the load times
   are the loaders' work, not the disk's.

The result is the fp8 / bf16 ratio of each. Host-side only, so it runs on any machine whose
memory holds the bf16 build: the published Wan 14B's 28 GB transformer does not fit a 24 GB
host, hence `--layers` (every block is the same size: 351 M parameters at 5120 wide, so the
transformer's share scales with N and the encoders' does not).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

KINDS = ("bf16", "fp8")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _touch(root) -> None:
    """Read one element of every 4 KiB page of every weight: a loader may hand back tensors that
    map the file (safetensors does) and read nothing until used, so without this the process's
    resident memory says nothing about what the host holds once the weights are used (copied to
    the card, pinned for offload)."""
    import torch

    with torch.no_grad():
        for t in [*root.parameters(), *root.buffers()]:
            if t.numel():
                t.detach().reshape(-1)[::max(1, 4096 // t.element_size())].float().sum()


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write(model: str, layers: int | None, directory: Path) -> dict[str, Any]:
    """Build at the (derived) config in bf16 and save both checkpoints under `directory`."""
    import torch

    from benchmarks.run import _assemble, _variant

    adapter, variant, note = _variant(argparse.Namespace(model=model, layers=layers, one_layer_encoders=False))
    print(f"[bench] write: building {variant.name} (random weights, bf16) ...", flush=True)
    t0 = time.perf_counter()
    handle, _ = _assemble(adapter, variant, gpu="cpu", dtype=torch.bfloat16, device=torch.device("cpu"),
                          compiled=False, backend=None, cache_dir=None, derived=layers is not None)
    built_s = time.perf_counter() - t0
    out = {"variant": variant.name, "variant_note": note, "build_s": round(built_s, 1)}
    for kind in KINDS:
        print(f"[bench] write: save_pretrained(precision={kind!r}) ...", flush=True)
        t0 = time.perf_counter()
        handle.save_pretrained(directory / kind, precision=None if kind == "bf16" else kind)
        out[f"save_{kind}_s"] = round(time.perf_counter() - t0, 1)
    out["write_peak_rss_gib"] = common.gib(_peak_rss_bytes())
    return out


def load(model: str, path: Path) -> dict[str, Any]:
    """One `magi_zoo.load` of the checkpoint at `path`, timed, with the host memory it took."""
    import magi_zoo
    from magi_zoo.engine import Fp8Linear
    from magi_zoo.engine.offload import resident_bytes

    before = _peak_rss_bytes()
    t0 = time.perf_counter()
    handle = magi_zoo.load(model, weights=str(path), gpu="cpu", dtype="bfloat16", compile=False)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    _touch(handle.modules)
    touch_s = time.perf_counter() - t0
    transformer = handle.pipe.transformer
    held = {"transformer": resident_bytes(transformer, "cpu"), "pipeline": resident_bytes(handle.modules, "cpu")}
    return {"load_s": round(load_s, 2), "touch_s": round(touch_s, 2), "peak_rss_gib": common.gib(_peak_rss_bytes()),
            "rss_before_load_gib": common.gib(before),  # the interpreter and its imports
            "transformer_bytes": held["transformer"], "transformer_gib": common.gib(held["transformer"]),
            "pipeline_bytes": held["pipeline"], "pipeline_gib": common.gib(held["pipeline"]),
            "fp8_linears": sum(isinstance(m, Fp8Linear) for m in transformer.modules()),
            "disk_gib": common.gib(_dir_bytes(path))}


def _child(args) -> None:
    result = write(args.model, args.layers, args.dir) if args.role == "write" else load(args.model, args.dir)
    Path(args.result).write_text(json.dumps({"status": "ok", **result}))


def _isolated(role: str, args, directory: Path, scratch: Path) -> dict[str, Any]:
    result = scratch / f"{role}_{directory.name}.json"
    argv = ["--role", role, "--model", args.model, "--dir", str(directory), "--result", str(result)]
    if args.layers is not None:
        argv += ["--layers", str(args.layers)]
    return common.run_isolated("benchmarks.fp8_checkpoint", argv, timeout=args.timeout, result_file=result)


def _ratio(rows: dict[str, dict], key: str) -> float | None:
    a, b = rows["bf16"].get(key), rows["fp8"].get(key)
    return round(b / a, 3) if a and b else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-i2v-14b-480p")
    ap.add_argument("--layers", type=int, default=None, help="N of the denoiser's blocks (default: all)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the two checkpoints are written (default: a temporary folder, removed after)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per step")
    ap.add_argument("--out", type=Path, default=common.results_dir("fp8_checkpoint"))
    ap.add_argument("--stem", default=None)
    ap.add_argument("--role", choices=("write", "load"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    common.add_commit_argument(ap)
    args = ap.parse_args(argv)
    if args.role:
        return _child(args)
    common.measured_commit()  # no result without its commit: refused before anything is built
    env = common.environment("cpu")
    env["host_memory_gib"] = common.gib(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    env["cpu_count"] = os.cpu_count()
    own = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="fp8ckpt_")) if own else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        written = _isolated("write", args, work, work)
        if written.get("status") != "ok":
            raise SystemExit(f"writing the checkpoints failed: {written.get('error')}")
        rows = {}
        for kind in KINDS:
            print(f"[bench] load {kind} checkpoint (fresh process) ...", flush=True)
            rows[kind] = {"checkpoint": kind, **_isolated("load", args, work / kind, work)}
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    ratios = {k: _ratio(rows, k) for k in ("peak_rss_gib", "transformer_bytes", "pipeline_bytes", "load_s", "touch_s",
                                          "disk_gib")}
    label = written["variant"]
    stem = args.stem or f"fp8_checkpoint_{label}_{common.card_tag(env, cuda=False)}"
    record = {"model": args.model, "variant": label, "variant_note": written["variant_note"], "layers": args.layers,
              "env": env, "command": "python -m benchmarks.fp8_checkpoint " + " ".join(sys.argv[1:]),
              "write": {k: v for k, v in written.items() if k != "status"},
              "rows": list(rows.values()), "fp8_over_bf16": ratios}
    columns = ["checkpoint", "status", "load_s", "touch_s", "peak_rss_gib", "transformer_gib", "pipeline_gib", "fp8_linears",
               "disk_gib", "error"]
    md = "\n\n".join([f"# fp8 checkpoint against bf16: host memory and load time ({label})", common.env_line(env),
                      written["variant_note"] or "", f"command: `{record['command']}`",
                      common.results_table(list(rows.values()), columns),
                      "fp8 / bf16: " + ", ".join(f"{k} {v}" for k, v in ratios.items())])
    common.publish(args.out, stem, record, md)


if __name__ == "__main__":
    main()
