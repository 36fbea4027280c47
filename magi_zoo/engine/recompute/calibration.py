"""Calibration of `auto` recompute: measure the blocks, estimate the step's peak, choose.

`calibrate(root, run)` runs the model once (`run`) with every auto region's wrapper in its
profiling path (`step._profile_call`: the first block of each region measured eagerly,
`measure.measure_block`), then runs that block's real forward and backward per option
(`measure.measure_options`), adds up what the training step holds besides the blocks'
activations (weights, optimizer states, gradients, FSDP2's in-flight copies), and lets
`auto.choose_within` pick one option per block under `RecomputeSpec.train_peak_gib`. The
choice goes to each block's wrapper and to the recompute step's record (the report).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .auto import Option, choose_within, options
from .measure import _call_device, _storage_key, measure_options
from .step import _did, _regions_under, _Region

GIB = 1024 ** 3


def _is_sharded(module: nn.Module) -> bool:
    try:
        # lazy: optional (torch builds without distributed have no FSDP2), and ~0.5 s to import
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


# FSDP2 under `magi_zoo.train.shard` on CUDA computes in bf16 and reduces gradients in fp32
# (its MixedPrecisionPolicy); elsewhere (CPU, no policy) in the parameters' own dtype.
_FSDP_COMPUTE_BYTES, _FSDP_REDUCE_BYTES = 2, 4


def fsdp_in_flight_bytes(blocks: Sequence[nn.Module], device: torch.device) -> int:
    """What FSDP2 holds beyond the shards while one block runs: the largest sharded block's
    all-gathered parameters twice (the block in flight and the one prefetched next, forward
    and backward) plus its unsharded gradient in the reduce dtype before the reduce-scatter.
    0 when no block is sharded. A DTensor's `numel()` is the whole (unsharded) tensor's."""
    sizes = [sum(p.numel() for p in m.parameters()) for m in blocks if _is_sharded(m)]
    if not sizes:
        return 0
    n = max(sizes)
    if device.type == "cuda":
        return n * (2 * _FSDP_COMPUTE_BYTES + _FSDP_REDUCE_BYTES)
    size = next(p.element_size() for m in blocks for p in m.parameters())
    return n * 3 * size


def _shapes(args: tuple, kwargs: dict) -> tuple:
    """The shapes and dtypes of a block call's tensor inputs (what a measurement depends on)."""
    items = [*args, *(kwargs[k] for k in sorted(kwargs))]
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in items)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor_bytes(tensors) -> int:
    """Bytes of distinct storages (a DTensor counts its local shard: what this rank holds)."""
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        key = _storage_key(t)
        if key not in seen and t.device.type != "meta":
            seen.add(key)
            total += key[1]
    return total


def calibrate(root: nn.Module, run: Callable[[], Any], *, measure_compiled: bool = True) -> list[dict[str, Any]]:
    """Measure every `auto` region under `root` and make its per-block choice.

    `run()` should call the model once on inputs of the training shape (its output is
    dropped). It runs without grad and with compiled regions forced eager; the first block
    of each auto region is measured (`measure_block`: op groups' output bytes and times).
    Then (`measure_compiled`, default) that block's real forward -- compiled where the plan
    compiles it -- runs once per option with grad on the same inputs, and the bytes autograd
    saves there replace the estimate where larger (`measure_options`). An FSDP2-sharded block
    cannot be run alone, so there the costs measured by an earlier calibration of the same
    blocks before sharding, at the same input shapes, are reused (else the eager estimate
    stands): calibrate before `shard` and again after it. Then one choice is made over all
    auto blocks against the budget (`train_peak_gib`): the estimated peak is

        memory live now (CUDA: allocated -- weights, inputs, whatever else is held; CPU: the
        weights on the blocks' device) + trainable weights x `optimizer_states` (they do not
        exist yet at calibration) + the gradients of trainable weights outside the auto
        blocks + the largest backward working set among the chosen options (one block runs
        its backward at a time; measured per option on CUDA, else the block's no-checkpoint
        bytes) + per auto block max(what it keeps, its parameters' gradient).

    The last term is the backward's timeline: it walks the blocks last to first, freeing a
    block's kept activations as it makes that block's gradients, so at any moment a block
    holds one or the other (the peak over the walk is at most the sum of those maxima;
    counting both, as a plain sum does, charges Wan-1.3B's 30 blocks 2.5 GiB twice).

    Under FSDP2 (blocks sharded with `fully_shard`), plus `fsdp_in_flight_bytes`: the
    all-gathered parameters of the block in flight and of the one prefetched, and the
    block's unsharded gradient before its reduce-scatter.

    Not counted: activations outside the blocks (embeddings, head, loss) and the caching
    allocator's fragmentation (reserved but unallocated; PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True keeps it small); leave headroom for them.

    The choice is written to the recompute step's record (the report) and returned, one
    dict per auto region. Calling it again re-measures and re-chooses.
    """
    regions = [r for r in _regions_under(root) if r.spec.policy == "auto"]
    if not regions:
        raise ValueError("calibrate: no recompute='auto' region under this module; nothing to measure")
    budgets = {r.spec.train_peak_gib for r in regions}
    if len(budgets) > 1 or len({r.spec.optimizer_states for r in regions}) > 1:
        raise ValueError("recompute='auto' regions of one model share one budget; give every auto region the "
                         f"same train_peak_gib and optimizer_states (got {sorted(budgets)})")
    for r in regions:
        # an earlier (unsharded) compiled measurement is kept for reuse once the block is
        # sharded, where it cannot be re-taken (below)
        r.profile, r.measured_before_sharding = None, False
        for st in r.states:
            st.profiling = True
    # With grad where nothing is sharded: the blocks' inputs then carry the requires_grad a
    # training step gives them (the blocks themselves run without, `_profile_call`), and the
    # compiled variants measured are those training reuses. An FSDP2 root's forward hooks
    # expect a backward after a grad-mode forward: without grad there.
    sharded = any(_is_sharded(m) for m in root.modules())
    try:
        with _force_eager(), torch.set_grad_enabled(not sharded):
            run()
    finally:
        for r in regions:
            for st in r.states:
                st.profiling = False
    try:
        missing = [r.key for r in regions if r.profile is None]
        if missing:
            raise RuntimeError(f"calibrate: run() never called the auto region(s) {missing}; pass a run that calls "
                               "the model's forward")
        # where the blocks compute: their inputs' device (the weights may live elsewhere:
        # FSDP2's CPU offload keeps the shards on the host)
        device = _call_device(*regions[0].sample[1:])[0]
        for r in regions:
            st, args, kwargs = r.sample
            # An FSDP2 block's forward outside the root's call would leave its all-gather /
            # backward hooks half run: the eager estimate stands there (shown in the report).
            at = _shapes(args, kwargs)
            if measure_compiled and not _is_sharded(st.module):
                r.measured, r.measured_at = measure_options(st, args, kwargs), at
            elif measure_compiled and r.measured is not None and r.measured_at == at:
                # Sharded now: the compiled costs measured before sharding stand (per-rank
                # activations and a block's backward do not change with sharding; what FSDP2
                # adds is `fsdp_in_flight_bytes`), so auto chooses from them, not the eager estimate.
                r.measured_before_sharding = True
            else:
                r.measured, r.measured_at = None, None
    finally:
        for r in regions:
            r.sample = None  # the block inputs: not kept past calibration
    spec = regions[0].spec
    params = list(root.parameters())
    # weights, gradients and optimizer states count where they live: on the blocks' device
    # (with FSDP2's CPU offload the shards, their gradients and the states are on the host)
    on_dev = [t for t in [*params, *root.buffers()] if _local(t).device == device]
    trainable = _tensor_bytes([p for p in on_dev if p.requires_grad])
    own = _tensor_bytes(on_dev)
    frozen = _tensor_bytes([t for t in on_dev if not t.requires_grad])
    if device.type == "cuda":
        gc.collect()  # what the profiling pass left in reference cycles is not live in training
        live = torch.cuda.memory_allocated(device)
    else:
        live = own
    other = max(0, live - own)  # on the card but no weight of these modules: inputs, leftovers
    for what, n in (("frozen weights (parameters without grad, e.g. a text encoder)", frozen),
                    ("tensors that are no weight of the model (inputs, leftovers)", other)):
        if n > GIB:
            warnings.warn(f"recompute='auto': {n / GIB:.1f} GiB of {what} on {device} count against the "
                          f"{spec.train_peak_gib:g} GiB budget; if the training step does not need them there, "
                          "move or free them and calibrate again (magi_zoo.train.calibrate(handle))",
                          RuntimeWarning, stacklevel=2)
    region_opts = {id(r): options(r.profile, r.measured) for r in regions}
    # Each option's backward working set: measured (CUDA), else what the block saves without
    # checkpointing (a recomputed block rebuilds at most that).
    region_work = {id(r): [_working_set(r, o) for o in region_opts[id(r)]] for r in regions}
    states = int(trainable * spec.optimizer_states)
    block_grads = {id(r): _tensor_bytes([p for p in r.states[0].module.parameters()
                                         if p.requires_grad and _local(p).device == device])
                   for r in regions}
    other_grads = max(0, trainable - sum(block_grads[id(r)] * len(r.states) for r in regions))
    in_flight = fsdp_in_flight_bytes([st.module for r in regions for st in r.states], device)
    fixed = live + states + other_grads + in_flight
    budget = spec.train_peak_gib * GIB
    blocks, works, owners = [], [], []
    for r in regions:
        # what a block costs at its worst moment: its kept activations, or later its gradient
        footprint = [dataclasses.replace(o, bytes=max(o.bytes, block_grads[id(r)])) for o in region_opts[id(r)]]
        for st in r.states:
            blocks.append(footprint)
            works.append(region_work[id(r)])
            owners.append((r, st))
    pick, transient = choose_within(blocks, works, budget - fixed)
    kept = sum(region_opts[id(r)][i].bytes for (r, _), i in zip(owners, pick.picks))
    summary = []
    for r in regions:
        opts = region_opts[id(r)]
        counts: dict[str, int] = {}
        for (reg, st), i in zip(owners, pick.picks):
            if reg is not r:
                continue
            o = opts[i]
            st.choose(o.save, o.name)
            st.decided = True
            if st.guard is not None:
                st.guard.remove()
                st.guard = None
            counts[o.name] = counts.get(o.name, 0) + 1
        r.choice = ", ".join(f"{n} x {name}" for name, n in counts.items())
        est = {o.name: o for o in options(r.profile)}
        summary.append({
            "region": r.key, "blocks": len(r.states), "choice": counts,
            "bytes_from": ("compiled forward + backward per option"
                           + (", measured before sharding" if r.measured_before_sharding else ""))
                          if r.measured is not None else "eager op outputs and times (estimate)",
            "options": [{"name": o.name, "bytes_per_block": o.bytes, "gib_per_block": round(o.bytes / GIB, 4),
                         "recompute_ms_per_block": round(o.recompute_s * 1e3, 3),
                         "eager_estimate_gib": round(est[o.name].bytes / GIB, 4),
                         "eager_estimate_ms": round(est[o.name].recompute_s * 1e3, 3),
                         "backward_working_set_gib": round(w / GIB, 4), "backward_working_set_bytes": int(w)}
                        for o, w in zip(opts, region_work[id(r)])],
        })
    est_peak = (fixed + transient + pick.bytes) / GIB
    accounting = {"budget_gib": spec.train_peak_gib, "live_gib": round(live / GIB, 3),
                  "frozen_weights_on_device_gib": round(frozen / GIB, 3), "other_live_gib": round(other / GIB, 3),
                  "optimizer_states_gib": round(states / GIB, 3), "gradients_gib": round(trainable / GIB, 3),
                  "gradients_outside_blocks_gib": round(other_grads / GIB, 3),
                  "fsdp_in_flight_gib": round(in_flight / GIB, 3),
                  "largest_block_backward_gib": round(transient / GIB, 3),
                  "kept_activations_gib": round(kept / GIB, 3),
                  "blocks_kept_or_gradient_gib": round(pick.bytes / GIB, 3), "estimated_peak_gib": round(est_peak, 3),
                  "estimated_peak_bytes": int(fixed + transient + pick.bytes),
                  "estimated_recompute_ms": round(pick.recompute_s * 1e3, 2), "fits": pick.fits}
    if not pick.fits:
        warnings.warn(f"recompute='auto': even full recompute everywhere is estimated at {est_peak:.3g} GiB, over the "
                      f"{spec.train_peak_gib:g} GiB budget (live now {live / GIB:.3g}, optimizer states "
                      f"{states / GIB:.3g}, gradients {trainable / GIB:.3g}); raise the budget, shard (FSDP) or "
                      "offload", RuntimeWarning, stacklevel=2)
    for r in regions:
        if r.record is not None:
            r.record.details.setdefault("auto", {})[r.key] = {**next(s for s in summary if s["region"] == r.key),
                                                                 **accounting}
    for record in {id(r.record): r.record for r in regions if r.record is not None}.values():
        record.did = _did([r for r in _regions_under(root) if r.record is record])
    return [{**s, **accounting} for s in summary]


def _working_set(r: _Region, o: Option) -> int:
    m = (r.measured or {}).get(o.name)
    if m is not None and m.transient is not None:
        return m.transient
    return r.profile.no_checkpoint_bytes if r.measured is None else max(
        r.profile.no_checkpoint_bytes, r.measured["no checkpoint"].bytes)


@contextlib.contextmanager
def _force_eager():
    # Calibration must not compile: compiled regions run their Python (our wrapper) eagerly.
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # pragma: no cover - torch < 2.6
        yield
        return
    with set_stance("force_eager"):
        yield
