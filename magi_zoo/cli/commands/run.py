"""`magi-zoo run`: build a model with its plan, generate, write the output; with `--nproc N`,
the same command in N processes (torchrun), rank 0 writing."""

from __future__ import annotations

import contextlib
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

from ... import distributed, zoo  # `zoo.load` looked up at call time: a patch of it reaches every command
from ...engine.observe.progress import Heartbeat
from ...engine.observe.progress import stage as progress_stage
from .. import console
from ..console import say
from ..notices import Captured, capture
from ..launch import launch
from ..writers import write_output
from .run_options import check_output_files, check_plan_keys, check_run


def cmd_run(args) -> int:
    # --nproc N: check what is cheap here, then run this same command in N processes (torchrun).
    if (args.nproc or 1) > 1 and not distributed.is_launched():
        request = check_run(args)
        check_plan_keys(args, request)  # a spec file's bad key: one error here, not one per rank after N builds
        return launch(args.nproc, args.argv)
    if distributed.init("cpu" if args.gpu == "cpu" else None):
        distributed.check_same(args.argv, "command lines")
    # A heartbeat line whenever the output was quiet for 1.25 s inside a named stage (build, the first
    # call's compiles, a stage without a bar); library notices captured unless --debug.
    beat = Heartbeat(console.BEAT_S, quiet_since=console.LAST_TICK[0] or None)  # goes on from the import ticker
    with distributed.quiet_unless_rank0(), beat, contextlib.ExitStack() as stack:
        with progress_stage("loading the model libraries"):  # capture() imports transformers / diffusers
            notices = stack.enter_context(nullcontext(Captured()) if args.debug else capture())
        code = _run(args, notices)
    distributed.shutdown()
    return code


def _run(args, notices: Captured) -> int:
    with progress_stage("checking the options"):
        request = check_run(args)
    if request.parallel is not None:
        request.options["seed"] = distributed.broadcast_seed(args.seed)  # one initial noise for every rank
    with progress_stage(f"building {args.model}"):
        say(f"building {args.model} ...")
        handle = zoo.load(args.model, gpu=args.gpu, weights=args.weights, dtype=args.dtype, compile=request.compile,
                      overrides=request.overrides, precision="fp8" if args.fp8 else None, spec_file=args.spec_file,
                      cache_dir=args.cache_dir, memory_budget_gib=args.memory_budget, parallel=request.parallel,
                      lora=request.lora)
    report = handle.report()
    if handle.cache is not None and handle.cache.status == "hit":  # one line: the first call reuses compiled code
        say(f"warm start: compile cache entry {handle.cache.path} loaded; the first call reuses its compiled code")
    for line in handle.lora.lines() if handle.lora is not None else []:
        say(line)
    if report is not None:
        n = sum(1 for r in report.regions if r.spec.enabled)
        say(f"compiling {n} region(s) on the first call (spec {args.spec_file or handle.adapter.spec_file}, "
            f"[gpu.{handle.profile.name}]); later steps reuse the code")
        if args.step_cache is not None:
            say(f"step cache: {report.step('step_cache').did}")
        offload = next((r for r in report.steps if r.step == "offload" and r.undo is not None), None)
        if offload is not None:  # weights stream: say what stays and what the copies cost
            say(f"offload: {offload.did}")
    rank0 = distributed.rank() == 0  # rank 0 writes; the others compute their share, quietly
    # counted before the call: a pipeline that truncates silently (Wan's UMT5) leaves no notice to read
    quiet_cut = handle.adapter.prompt_truncation(handle.pipe, args.prompt, {**handle.call_defaults(),
                                                                              **request.options})
    first = "generating (the first call compiles)" if report is not None and report.frames == 0 else "generating"
    with progress_stage(first):
        written = generate_to(handle, prompt=args.prompt, out=args.out, progress=rank0, write=rank0,
                              overwrite=args.overwrite, **request.options)
    cut = {**quiet_cut, **notices.truncations()}
    if cut:  # the one notice a user can act on, as one line (diffusers echoes every dropped token)
        say(f"prompt truncated: {len(args.prompt)} characters; the text encoders read at most "
            + ", ".join(f"{n} tokens ({enc})" for enc, n in cut.items()))
    for path in written:
        say(f"wrote {path}")
    if report is not None:  # after the output is written: a report problem never costs it
        say(report.table())
        details = report.details()  # graph-break and recompile reasons, with torch's user stack traces
        if details and args.debug:
            say(details)
        elif details:  # a normal run: how many, not torch's ~20-line stack traces
            say(f"compile notes: {report.graph_breaks} graph break(s), {report.recompiles} recompile(s) "
                "(expected where a shape or cache state changes); magi-zoo run ... --debug prints the reasons")
    summary = notices.summary()  # --debug captured nothing: the notices printed as they came
    if summary:
        say(summary)
    return 0


def generate_to(handle, *, prompt: str, out: str | Path, progress: bool = True, write: bool = True,
                overwrite: bool = True, on_generated: Callable[[], None] | None = None, **options) -> list[Path]:
    """`magi-zoo run` after the build: check the options and the paths it will write (before
    the generation: a path that cannot be written never costs one; `overwrite=False`: an
    existing file is refused), generate through the handle, write (`write=False`: generate
    only -- the ranks other than 0 of a multi-process run). `on_generated` is called between
    the generation and the write (a server stops reading progress bars there: a writer's own
    bar, such as the video encoder's, is no step of the generation)."""
    given = handle.adapter.check_run(handle.variant, options, Path(out))
    if write:
        check_output_files(out, given.get("audio_out"), overwrite=overwrite,
                           inputs={"--image": given.get("image"), "--audio": given.get("audio")})
    output = handle.adapter.generate(handle, prompt=prompt, progress=progress, **given)
    if on_generated is not None:
        on_generated()
    if not write:
        return []
    if output.note and progress:
        say(output.note)
    return write_output(output, out, given.get("audio_out"))
