"""Measuring a block: what its forward saves for backward and what each op group costs.

Two measurements feed the `auto` solver (`auto.options`):

- `measure_block`: one eager forward under an op-recording dispatch mode (`_OpRecorder`:
  per op group the bytes of the outputs and the seconds) and a saved-tensors pack hook
  (`_SavedStorages`: what autograd keeps without checkpointing) -> a `BlockProfile`;
- `measure_options`: the block's real forward -- the installed wrapper, compiled where the
  plan compiles it -- and backward run once per option -> an `OptionCost` each.

Both fork the RNG (a measurement must not move what a training step draws) and give the
block fresh leaf inputs with training's requires_grad.

Every size here is a sum of tensor sizes, never an allocator reading that depends on the
cap or on what ran before: an op's new outputs are the storages that are none of its
inputs' (not "an address not seen yet": a freed output's address is reused, more or less
often depending on the allocator's state); saved storages are held while they are counted,
so no two can share an address; a backward's working set is `LiveBytes` (the tensors the
ops make, each counted until it is freed) off CUDA, and on CUDA the allocator's *allocated*
peak over one forward + backward -- requested sizes rounded to 512 bytes, which a cap or
fragmentation does not change (they change what is *reserved*).
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn

from ..compat.torch import TorchDispatchMode, tree_leaves, tree_map
from .auto import AUTO_SAVES, BlockProfile, GroupCost, OptionCost
from .policy import DOWN, is_down_projection, op_group, option_name


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _input_keys(args: tuple, kwargs: dict | None) -> set:
    keys = set()
    for t in tree_leaves((args, kwargs or {})):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            try:
                keys.add(_storage_key(t))
            except (RuntimeError, NotImplementedError):  # a wrapper subclass without a storage of its own
                pass
    return keys


def _new_outputs(out: Any, args: tuple, kwargs: dict | None) -> dict:
    """key -> storage of an op's outputs that are new: none of its inputs' storages (a view
    or an in-place result is not new memory). The inputs are alive during the op, so this
    does not depend on which addresses the allocator hands out."""
    inputs = _input_keys(args, kwargs)
    new = {}
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = _storage_key(t)
            if key not in inputs:
                new[key] = t.untyped_storage()
    return new


class _OpRecorder(TorchDispatchMode):
    """Records, per op group, the bytes of each op's new outputs (`_new_outputs`) and its
    time (synchronised around every op on CUDA: a profiling pass, not a fast one)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.groups: dict[str, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sync()
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.sync()
        dt = time.perf_counter() - t0
        nbytes = sum(k[1] for k in _new_outputs(out, args, kwargs))
        names = [op_group(func)]
        if names[0] == "matmuls" and is_down_projection(func, args):
            names.append(DOWN)  # also counted apart: a subset of the matmuls
        for name in names:
            g = self.groups.setdefault(name, [0, 0.0, 0])
            g[0] += nbytes
            g[1] += dt
            g[2] += 1
        return out


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors made under this mode that are still alive: each op's new outputs
    (`_new_outputs`) counted when made and uncounted when their storage is freed (a weakref
    finalizer); `peak` is the most at any moment. A measurement of sizes, the same whatever
    the allocator did before or caps it at. It sees what dispatches through aten (eager ops,
    autograd's backward, `aot_eager` graphs), not memory a compiled kernel allocates on its
    own (inductor's buffers): on CUDA use the allocator's *allocated* peak there."""

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, storage in _new_outputs(out, args, kwargs).items():
            if id(storage) in self._alive:
                continue
            self._alive.add(id(storage))
            self.current += key[1]
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, id(storage), key[1])
        return out

    def _freed(self, ident: int, nbytes: int) -> None:
        self._alive.discard(ident)
        self.current -= nbytes


@contextlib.contextmanager
def _measuring(live: "LiveBytes | None"):
    """`live` entered, with compiled regions run eagerly (dynamo refuses a frame under a
    dispatch mode of ours; the eager variant makes and frees the same tensors up to what
    a compiler fuses away); nothing when `live` is None."""
    if live is None:
        yield
        return
    set_stance = getattr(torch.compiler, "set_stance", None)
    with (set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()), live:
        yield


def measure_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run `fn()` under `LiveBytes` (compiled regions eager): (its result, the peak bytes of
    the tensors it made and held at once). Add what was alive before (weights, inputs) for
    the peak of the whole process."""
    gc.collect()
    live = LiveBytes()
    with _measuring(live):
        out = fn()
    return out, live.peak


def _as_grad_input(x: Any) -> Any:
    # Inputs seen without grad: give floating ones requires_grad, as the residual stream has
    # in a training step, so autograd saves what it would save then.
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_(True)
    return x


def _training_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Fresh leaves for a profiled block call. Where the call came from a grad-mode forward
    (calibrate's), each input keeps its own requires_grad -- what a training step passes, so
    a compiled block is measured in the variant training runs (dynamo guards on the flag);
    where nothing requires grad (a forward without grad), every floating input gets it."""
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.requires_grad for t in leaves):
        return tree_map(_as_grad_input, (args, kwargs))

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().requires_grad_(x.requires_grad)
        return x

    return tree_map(leaf, (args, kwargs))


class _SavedStorages:
    """A saved-tensors pack hook that records the storages autograd saves for backward
    (`keys`), parameters excluded; `with recorder.hooks():` around a forward."""

    def __init__(self, params: set):
        self.params = params
        self.held: dict = {}  # key -> storage: held while counted, so no two share an address

    @property
    def keys(self) -> set:
        return set(self.held)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            key = _storage_key(t)
            if key not in self.params:
                self.held[key] = t.untyped_storage()
        # Not `t` itself: a saved output packed with its grad_fn is a node -> tensor -> node
        # cycle in C++ that no gc sees, and the whole profiled graph (GiBs at the Wan shape)
        # would stay on the card for good. Nothing backwards through what this packs.
        return t.detach()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _call_device(args: tuple, kwargs: dict) -> tuple[torch.device, list[int]]:
    """The device of a block call's first tensor, and the CUDA devices whose RNG a profiled
    call forks (a profiled forward must not move the RNG a training step will use)."""
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    cuda_ids = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    return device, cuda_ids


def _input_storages(args: tuple, kwargs: dict, out: Any) -> tuple[set, set]:
    """(boundary, shared) storage keys of a block call's inputs: the boundary inputs are shaped
    like an output (the residual stream the block passes on, its own); the others -- text
    states, time embedding, RoPE tables -- are one storage for all blocks, live anyway."""
    shapes = {tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    boundary = {_storage_key(t) for t in inputs if tuple(t.shape) in shapes}
    return boundary, {_storage_key(t) for t in inputs} - boundary


def measure_block(fn: Callable, args: tuple, kwargs: dict, *, module: nn.Module | None = None,
                  repeats: int = 2) -> BlockProfile:
    """Run one block forward (`fn(*args, **kwargs)`, eager, no checkpoint) `repeats` times
    under the op recorder and saved-tensor hooks; the last run's timings count (the first
    warms kernels and allocators up). `module` (default: `fn`'s instance): its parameters
    are not activations, whatever autograd saves of them."""
    device, cuda_ids = _call_device(args, kwargs)
    module = module if module is not None else getattr(fn, "__self__", None)
    params = {_storage_key(p) for p in module.parameters()} if isinstance(module, nn.Module) else set()
    prof = None
    for _ in range(repeats):
        a, k = _training_inputs(args, kwargs)
        saved = _SavedStorages(params)
        rec = _OpRecorder(device)
        with torch.random.fork_rng(devices=cuda_ids), torch.enable_grad(), saved.hooks():
            t0 = time.perf_counter()
            with rec:
                out = fn(*a, **k)
            rec.sync()
            total = time.perf_counter() - t0
        boundary, _ = _input_storages(a, k, out)
        prof = BlockProfile(
            groups={g: GroupCost(int(v[0]), float(v[1]), int(v[2])) for g, v in rec.groups.items()},
            forward_s=total,
            boundary_bytes=sum(n for _, n in boundary),
            no_checkpoint_bytes=sum(n for _, n in saved.keys | boundary),
        )
        del out, saved
    return prof


def measure_options(state: Any, args: tuple, kwargs: dict, *, repeats: int = 3) -> dict[str, OptionCost]:
    """What each `auto` option really costs one block (`state`: its `step.BlockState`, whose
    choice is switched per option and put back after): the block's own forward -- the
    installed wrapper, compiled where the plan compiles it -- run per option with grad on
    `args`/`kwargs`, then backward (a ones gradient), `repeats` times; the first run warms
    up (compiles), the fastest of the rest counts.

    bytes: the distinct storages autograd saves (parameters and inputs all blocks share
    excluded) plus the block's residual input. Saved-tensor hooks see what a compiled region
    saves for its backward, so this is what the partitioner decided, not what the eager ops
    produce (eager selective checkpoints keep their outputs out of the hooks' sight -- on
    every torch: the wrapper passes `compat.torch.checkpoint_hooks_kwargs()` -- so
    `options` takes the larger of the two). Each option is one compiled variant of the block
    (guards on its state), the same variants training then reuses. The block's parameter
    gradients are left as they were. Each option's `transient` (its backward's working set):
    on CUDA the allocator's *allocated* peak over a timed forward + backward (this resets the
    device's peak-memory statistics), elsewhere `LiveBytes` over the last run (untimed there)."""
    module = state.module
    params = {_storage_key(p) for p in module.parameters()}
    device, cuda_ids = _call_device(args, kwargs)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prior = (state.checkpointed, state.context_fn, state.decided, state.label)
    grads = {p: p.grad for p in module.parameters()}
    costs: dict[str, OptionCost] = {}
    try:
        for save in (*AUTO_SAVES, None):
            state.choose(save)
            state.decided = True
            nbytes, times, transient = 0, [], None
            # the timed runs (the first warms up and compiles); off CUDA the last run is untimed,
            # under `LiveBytes`, for the working set (on CUDA the timed runs read the allocator);
            # at least two timed runs either way
            runs = max(2, repeats) if cuda_ids else max(3, repeats)
            for i in range(runs):
                live = LiveBytes() if not cuda_ids and i == runs - 1 else None
                a, k = _training_inputs(args, kwargs)
                saved = _SavedStorages(params)
                with torch.random.fork_rng(devices=cuda_ids), torch.enable_grad(), _measuring(live):
                    sync()
                    if cuda_ids:
                        gc.collect()
                        torch.cuda.reset_peak_memory_stats(device)
                        base = torch.cuda.memory_allocated(device)
                    t0 = time.perf_counter()
                    with saved.hooks():
                        out = module(*a, **k)
                    boundary, shared = _input_storages(a, k, out)
                    # counted now, while autograd holds them too; then let go, so the
                    # backward frees each as it would in training
                    nbytes = sum(n for _, n in (saved.keys - shared) | boundary)  # shared inputs: not this block's
                    saved.held.clear()
                    outs = [t for t in tree_leaves(out)
                            if isinstance(t, torch.Tensor) and t.requires_grad]
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                    sync()
                    if isinstance(live, LiveBytes):
                        peak = live.peak
                    else:
                        times.append(time.perf_counter() - t0)
                        peak = torch.cuda.max_memory_allocated(device) - base if cuda_ids else None
                # what the backward needs above the kept activations (the boundary input
                # existed before the call, so it is in neither the allocator's delta nor LiveBytes')
                if peak is not None:
                    transient = max(0, peak - (nbytes - sum(n for _, n in boundary)))
                del out, outs, a, k, saved
                for p in grads:
                    p.grad = None
            costs[option_name(save)] = OptionCost(nbytes, min(times[1:]), transient)
    finally:
        state.checkpointed, state.context_fn, state.decided, state.label = prior
        state.retarget()
        for p, g in grads.items():
            p.grad = g
    return costs
