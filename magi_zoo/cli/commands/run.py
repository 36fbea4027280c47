"""`magi-zoo run`: build a model with its plan, generate, write the output; with `--nproc N`,
the same command in N processes (torchrun), rank 0 writing."""

from __future__ import annotations

from pathlib import Path

from ... import distributed, zoo  # `zoo.load` looked up at call time: a patch of it reaches every command
from ..console import say
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
    with distributed.quiet_unless_rank0():
        code = _run(args)
    distributed.shutdown()
    return code


def _run(args) -> int:
    request = check_run(args)
    if request.parallel is not None:
        request.options["seed"] = distributed.broadcast_seed(args.seed)  # one initial noise for every rank
    handle = zoo.load(args.model, gpu=args.gpu, weights=args.weights, dtype=args.dtype, compile=request.compile,
                  overrides=request.overrides, precision="fp8" if args.fp8 else None, spec_file=args.spec_file,
                  cache_dir=args.cache_dir, memory_budget_gib=args.memory_budget, parallel=request.parallel,
                  lora=request.lora)
    report = handle.report()
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
    written = generate_to(handle, prompt=args.prompt, out=args.out, progress=rank0, write=rank0,
                          overwrite=args.overwrite, **request.options)
    for path in written:
        say(f"wrote {path}")
    if report is not None:  # after the output is written: a report problem never costs it
        say(report.table())
        details = report.details()  # graph-break and recompile reasons, one per line
        if details:
            say(details)
    return 0


def generate_to(handle, *, prompt: str, out: str | Path, progress: bool = True, write: bool = True,
                overwrite: bool = True, **options) -> list[Path]:
    """`magi-zoo run` after the build: check the options and the paths it will write (before
    the generation: a path that cannot be written never costs one; `overwrite=False`: an
    existing file is refused), generate through the handle, write (`write=False`: generate
    only -- the ranks other than 0 of a multi-process run)."""
    given = handle.adapter.check_run(handle.variant, options, Path(out))
    if write:
        check_output_files(out, given.get("audio_out"), overwrite=overwrite)
    output = handle.adapter.generate(handle, prompt=prompt, progress=progress, **given)
    if not write:
        return []
    if output.note and progress:
        say(output.note)
    return write_output(output, out, given.get("audio_out"))
