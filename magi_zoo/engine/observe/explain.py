"""`explain_call`: run one call with torch's structured compile trace on, write a folder a
user can read.

What torch emits during a compile (the records TORCH_TRACE / tlparse read), received in
process through `compat.torch.structured_trace` and filed by compile id and region:

    OUT/summary.md                     one page: regions, graphs, breaks, recompiles, next steps
    OUT/graph_breaks.md                every break: the user's file:line, reason, suggested fix
    OUT/recompiles.md                  every recompile with the guard that failed
    OUT/regions/<region>/<id>_<frame>/ per compiled frame (compile id "frame/attempt"):
        dynamo_graph.py                the FX graph dynamo captured (user-level ops)
        aot_graph.py                   after AOTAutograd (aten ops), when the backend runs it
        post_grad_graph.py             what inductor lowered (inductor only)
        output_code.py                 the code inductor generated (inductor only)
        guards.txt                     the guards that decide when this code is reused
        metrics.json                   torch's compile record (times, op count, recompile reason)
    OUT/graph_breaks/NN.txt            torch's full text of each break (user traceback)
    OUT/events.jsonl                   every structured record's metadata, for tlparse-style digging
    OUT/report.txt                     the engine's report after the call (when given one)

Model-agnostic: `fn` is any callable; a compiled region is found by its engine wrapper
(`accounting.tracked`) on the Python stack when torch logs, so records are filed under
the region the compile happened in ("call" when none: a plain `torch.compile`d function).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..compat import torch as compat
from . import accounting
from .table import format_table

# Structured record -> file written per compile id (the last record of a name wins: a
# restarted analysis re-emits its graph, and the final one is what runs).
_FILES = {
    "dynamo_output_graph": "dynamo_graph.py",
    "aot_inference_graph": "aot_graph.py",
    "aot_forward_graph": "aot_graph.py",
    "inductor_post_grad_graph": "post_grad_graph.py",
    "inductor_output_code": "output_code.py",
    "dynamo_cpp_guards_str": "guards.txt",
}

# Fallback fixes by reason, for torch versions whose break messages carry no "Hint:".
_FIXES = [
    ("item()", "keep the value a tensor (no `.item()` / `int()` / `float()` on tensors), or set "
               "torch._dynamo.config.capture_scalar_outputs = True"),
    ("data-dependent", "branch with torch.where / torch.cond instead of Python `if` on tensor values"),
    ("print", "remove print / logging calls from the compiled code"),
    ("skip", "the function is marked skip / torch.compiler.disable: register it as a custom op "
             "(magi_zoo.engine.custom_ops) so the graph stays whole"),
    ("disable", "the function is marked torch.compiler.disable: register it as a custom op "
                "(magi_zoo.engine.custom_ops) so the graph stays whole"),
    ("numpy", "use torch ops instead of numpy inside the region"),
    ("generator", "avoid generators / iterators over tensors inside the region"),
]
_GENERIC_FIX = ("move the unsupported call out of the compiled region, or split the region there "
                "(a plan key on the submodule before / after it)")

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclasses.dataclass
class GraphBreak:
    region: str
    compile_id: str
    where: str  # the user's file:line (innermost frame outside torch)
    function: str
    reason: str  # the first line of torch's message
    fix: str
    stack: list[str]  # "file:line in fn", outermost first
    text: str  # torch's full message (file graph_breaks/NN.txt)


@dataclasses.dataclass
class Compile:
    region: str
    compile_id: str  # "frame/attempt", torch's numbering
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # file name -> text
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def frame(self) -> str:
        return str(self.metrics.get("co_name") or "frame")

    @property
    def recompile_reason(self) -> str | None:
        return self.metrics.get("recompile_reason")


@dataclasses.dataclass
class Explanation:
    """What `explain_call` found; `out_dir` holds the files."""

    out_dir: Path
    compiles: list[Compile]
    breaks: list[GraphBreak]
    seconds: float
    summary: str

    @property
    def recompiles(self) -> list[Compile]:
        return [c for c in self.compiles if c.recompile_reason]

    def __str__(self) -> str:
        return self.summary


def _current_region() -> str:
    """The label of the innermost engine region on the Python stack ("call" if none):
    torch compiles synchronously inside the region's call, so that is where it belongs."""
    f = sys._getframe(1)
    code = accounting.tracked.__code__
    while f is not None:
        if f.f_code.co_name == "region_call" and f.f_code.co_filename == code.co_filename:
            stats = f.f_locals.get("stats")
            if stats is not None:
                return stats.label
        f = f.f_back
    return "call"


def _fix_for(exc: BaseException | None, reason: str) -> str:
    hints = [ln.strip()[len("Hint:"):].strip() for ln in str(exc or "").splitlines()
             if ln.strip().startswith("Hint:")]
    if hints:
        return " / ".join(hints)
    low = reason.lower()
    for needle, fix in _FIXES:
        if needle in low:
            return fix
    return _GENERIC_FIX


class _Collector(logging.Handler):
    """Files torch's structured records by compile id and region as they arrive."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.compiles: dict[str, Compile] = {}
        self.breaks: list[GraphBreak] = []
        self.events: list[dict[str, Any]] = []
        self._seen_breaks: set[tuple] = set()

    def _compile(self, md: dict[str, Any]) -> Compile | None:
        if md.get("frame_id") is None:
            return None
        cid = f"{md['frame_id']}/{md.get('frame_compile_id', 0)}"
        c = self.compiles.get(cid)
        if c is None:
            c = self.compiles[cid] = Compile(region=_current_region(), compile_id=cid)
        return c

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._emit(record)
        except Exception:  # a failing explain must never fail the user's call
            pass

    def _emit(self, record: logging.LogRecord) -> None:
        md = getattr(record, "metadata", None)
        if not isinstance(md, dict):
            return
        payload = getattr(record, "payload", None)
        name = next((k for k in md if k not in ("frame_id", "frame_compile_id", "attempt", "rank",
                                                "stack", "has_payload", "compiled_autograd_id",
                                                "subgraph_name")), None)
        if name is None or name == "chromium_event":
            return
        inner = md.get(name)
        artifact = inner.get("name") if name == "artifact" and isinstance(inner, dict) else None
        self.events.append({"event": artifact or name, **{k: v for k, v in md.items() if k != name},
                            **({"metadata": inner} if isinstance(inner, dict) and not artifact else {})})
        c = self._compile(md)
        if c is None:
            return
        # A graph arrives under its own name or as an artifact of that name: inductor's
        # post-grad graph is an artifact when inductor compiles, a record of its own on a
        # cache hit (an empty inductor cache lost the file before).
        if (artifact or name) in _FILES and payload:
            c.files[_FILES[artifact or name]] = payload
        elif name == "compilation_metrics" and isinstance(inner, dict):
            c.metrics = {k: v for k, v in inner.items() if _jsonable(v)}
        elif artifact == "dynamo_graph_break_reason":
            self._graph_break(c, payload or "")

    def _graph_break(self, c: Compile, text: str) -> None:
        stack, exc = compat.graph_break_in_flight()
        frames = [(f.filename, f.lineno, f.name) for f in stack]
        user = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
        fn_file, line, fn = user[-1] if user else ("?", 0, "?")
        msg = getattr(exc, "msg", None) or str(exc or "") or text
        reason = msg.strip().splitlines()[0] if msg.strip() else "graph break"
        key = (c.compile_id, fn_file, line, reason)
        if key in self._seen_breaks:
            return
        self._seen_breaks.add(key)
        self.breaks.append(GraphBreak(
            region=c.region, compile_id=c.compile_id, where=f"{fn_file}:{line}", function=fn,
            reason=reason, fix=_fix_for(exc, reason),
            stack=[f"{a}:{b} in {n}" for a, b, n in frames], text=text))


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "root"


def explain_call(fn: Callable, kwargs: dict[str, Any], out_dir: str | Path, report: Any = None, *,
                 args: tuple = (), fresh: bool = True) -> Explanation:
    """Call `fn(*args, **kwargs)` once with torch's structured compile trace captured, and
    write what torch did under `out_dir` (see the module docstring for the layout).

    fresh: reset torch's in-process compile caches first (`torch.compiler.reset()`), so
    the call compiles and is logged even when this process compiled it before (torch's
    on-disk caches still make that fast).
    report: the engine `Report` of the plan applied to `fn`'s module: its table and the
    per-region counters go into the summary.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"explain: {str(out)!r} exists and is not a directory; pass a directory")
    out.mkdir(parents=True, exist_ok=True)
    if fresh:
        torch.compiler.reset()
    collector = _Collector()
    t0 = time.perf_counter()
    with compat.structured_trace(collector), torch.no_grad():
        fn(*args, **kwargs)
    seconds = time.perf_counter() - t0
    compiles = sorted(collector.compiles.values(),
                      key=lambda c: tuple(int(x) for x in c.compile_id.split("/")))
    _write(out, compiles, collector, report)
    summary = _summary(out, compiles, collector.breaks, report, seconds)
    (out / "summary.md").write_text(summary, encoding="utf-8")
    return Explanation(out, compiles, collector.breaks, seconds, summary)


def _dir_of(out: Path, c: Compile) -> Path:
    return out / "regions" / _safe(c.region) / _safe(f"{c.compile_id.replace('/', '_')}_{c.frame}")


def _write(out: Path, compiles: list[Compile], collector: _Collector, report: Any) -> None:
    for c in compiles:
        d = _dir_of(out, c)
        d.mkdir(parents=True, exist_ok=True)
        for fname, text in c.files.items():
            (d / fname).write_text(text, encoding="utf-8")
        (d / "metrics.json").write_text(json.dumps(c.metrics, indent=1, default=str), encoding="utf-8")
    lines = ["# Graph breaks", ""]
    if not collector.breaks:
        lines.append("None: every compiled frame is one graph.")
    if collector.breaks:
        (out / "graph_breaks").mkdir(exist_ok=True)
    for i, b in enumerate(collector.breaks, 1):
        (out / "graph_breaks" / f"{i:02d}.txt").write_text(b.text, encoding="utf-8")
        lines += [f"## {i}. {b.where} (in `{b.function}`), region `{b.region}`, compile {b.compile_id}", "",
                  f"- reason: {b.reason}", f"- suggested fix: {b.fix}",
                  f"- user stack: {' <- '.join(reversed(b.stack[-4:]))}",
                  f"- torch's full message: graph_breaks/{i:02d}.txt", ""]
    (out / "graph_breaks.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    rec = [c for c in compiles if c.recompile_reason]
    lines = ["# Recompiles", ""] + ([f"- region `{c.region}`, compile {c.compile_id} (`{c.frame}`): "
                                     f"{c.recompile_reason.strip()}" for c in rec]
                                   or ["None: every frame compiled once."])
    lines += ["", "Each compile's guards (the checks that decide whether its code is reused) are in "
              "regions/<region>/<compile>/guards.txt."]
    (out / "recompiles.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with open(out / "events.jsonl", "w", encoding="utf-8") as f:
        for e in collector.events:
            f.write(json.dumps(e, default=str) + "\n")
    if report is not None:
        (out / "report.txt").write_text(str(report) + "\n", encoding="utf-8")


def _summary(out: Path, compiles: list[Compile], breaks: list[GraphBreak], report: Any,
             seconds: float) -> str:
    lines = ["# What torch.compile did", "",
             f"One call, {seconds:.1f} s (compile included); torch {torch.__version__}. "
             f"{len(compiles)} frame compile(s), {len(breaks)} graph break(s), "
             f"{sum(1 for c in compiles if c.recompile_reason)} recompile(s).", ""]
    if report is not None and getattr(report, "notes", None):  # what the model was built with (LoRAs)
        lines += ["## The model as built", "", *(f"- {n}" for n in report.notes), ""]
    if report is not None:
        lines += ["## Regions of the plan (engine counters for this call)", "", report.table(), ""]
    lines += ["## Compiled frames", ""]
    if compiles:
        rows = []
        for c in compiles:
            d = _dir_of(out, c).relative_to(out)
            m = c.metrics
            rows.append({"region": c.region, "compile id": c.compile_id, "frame": c.frame,
                         "ops": m.get("graph_op_count", "-"), "guards": m.get("guard_count", "-"),
                         "compile s": f"{float(m.get('entire_frame_compile_time_s') or 0):.2f}",
                         "files": f"{d}/ ({', '.join(sorted(c.files))})" if c.files else f"{d}/ (metrics only)"})
        lines += [format_table(rows), ""]
        if not any("output_code.py" in c.files for c in compiles):
            lines += ["No generated code: no region used the inductor backend (eager / aot_eager "
                      "backends run the captured graph as is).", ""]
    else:
        lines += ["Nothing compiled in this call: no region is enabled, or every region ran "
                  "eagerly (see report.txt).", ""]
    lines += ["## Graph breaks", ""]
    if breaks:
        for b in breaks:
            lines.append(f"- `{b.where}` (region `{b.region}`): {b.reason}. Fix: {b.fix}")
        lines.append("")
        lines.append("Details and torch's full messages: graph_breaks.md.")
    else:
        lines.append("None.")
    lines += ["", "## Recompiles", ""]
    rec = [c for c in compiles if c.recompile_reason]
    lines += [f"- `{c.region}` {c.compile_id}: {c.recompile_reason.strip()}" for c in rec] or ["None."]
    lines += ["", "## Where to look next", "",
              "- regions/<region>/<compile>/dynamo_graph.py: the ops captured, with the user's source lines;",
              "- output_code.py: the kernels inductor generated; guards.txt: when the code is reused;",
              "- graph_breaks.md, recompiles.md; events.jsonl: every structured compile record."]
    return "\n".join(lines) + "\n"
