"""The parallel step: spread a denoiser's forward over the processes of a `torchrun` job.

Runs last (after compile and offload), so everything it adds wraps the compiled regions
from outside. Two mechanisms, both per region of the plan's ``parallel`` section:

- **Sequence parallelism** (Ulysses / ring) is diffusers' own: ``model.enable_parallelism(
  ContextParallelConfig(...))``. It registers hooks from the model's ``_cp_plan`` that
  split inputs along the sequence (e.g. Wan: ``blocks.0``'s ``hidden_states``, the RoPE
  tables) and all-gather the output (``proj_out``), and gives every self-attention
  processor the config, so attention dispatch runs Ulysses all-to-alls or the ring around
  the kernel. Why that composes with regional compile here and not in diffusers'
  ``compile_repeated_blocks`` (DESIGN.md section 6: that fails tracing the hook's
  ``inspect.signature``): our compile step replaces the block's *forward*, and a diffusers
  hook installed afterwards wraps that compiled forward from outside -- the split/gather
  hooks run eagerly, and inside the compiled block only the attention's collectives
  remain, which diffusers writes as functional collectives (``funcol.all_to_all_single``)
  that dynamo traces into the graph (no graph break; tests count them). One adjustment:
  the split hands block 0 a *view* of the full sequence, where blocks 1..N-1 get fresh
  tensors; dynamo then guards on the view's storage offset and compiles block 0 twice, so
  a hook inside the split makes that input a fresh tensor (one copy of 1/N of the hidden
  states per forward) and all blocks share one compile again.
- **CFG parallelism** diffusers does not have for these pipelines, so it is a small hook
  here (`CfgParallelHook`): pipelines mark each denoiser call with
  ``model.cache_context("cond" | "uncond")``; the rank of the cond branch computes the cond
  call and skips the uncond one, the other rank the reverse, and at the uncond call the
  two outputs are all-gathered (outside any compiled region). The cond call's result on
  the uncond rank is a placeholder tensor the hook fills in place at the exchange, before
  the pipeline reads it (it reads both only after the uncond call, to combine them).

Undo is exact: every hook is removed by name, registries and attributes the step created
are deleted, the processors' and the model's ``_parallel_config`` go back to what they
were. The process groups of the device mesh stay (a process-level resource, reused by the
next apply).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn

from .. import distributed
from ..specs.parallel_spec import ParallelSpec
from .steps import StepContext, StepRecord, chain_undo

CFG_HOOK = "magi_zoo_cfg_parallel"
UNEVEN_HOOK = "magi_zoo_cp_uneven_refusal"
FRESH_HOOK = "magi_zoo_cp_fresh_inputs"
_SHARD_ASSERT = "must be divisible by mesh size"  # diffusers' EquipartitionSharder assertion text


# -- CFG parallel -------------------------------------------------------------------------------
def _hooks():
    from diffusers.hooks.hooks import BaseState, HookRegistry, ModelHook, StateManager

    return BaseState, HookRegistry, ModelHook, StateManager


def _sample(out: Any) -> torch.Tensor:
    """The tensor of a diffusers transformer output: ``(sample,)`` or an output with `.sample`."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    sample = getattr(out, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    raise TypeError(f"cfg parallel: the denoiser returned {type(out).__name__}; expected a diffusers transformer "
                    "output ((sample,) or an object with .sample)")


def _wrap(sample: torch.Tensor, like: Any, return_dict: bool) -> Any:
    """`sample` in the structure a diffusers transformer returns (`like` if known)."""
    if like is not None and not isinstance(like, (tuple, list, torch.Tensor)):
        return type(like)(sample=sample)
    if isinstance(like, torch.Tensor):
        return sample
    if like is not None or not return_dict:
        return (sample,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)


def _make_cfg_hook(group, branch: int):
    BaseState, _, ModelHook, StateManager = _hooks()

    class CfgParallelHook(ModelHook):
        """Runs one branch of classifier-free guidance on this rank (`branch` 0 = cond,
        1 = uncond) and exchanges the outputs with the other rank of its cfg pair."""

        _is_stateful = True  # so diffusers' cache_context tells it which branch a call is

        def __init__(self):
            super().__init__()
            self.state = StateManager(BaseState)
            self.group, self.branch = group, branch
            self.pending: torch.Tensor | None = None  # branch 0: the cond output; 1: the placeholder
            self.like: Any = None

        def reset_state(self, module):
            self.pending = None
            self.state.reset()
            return module

        def new_forward(self, module, *args, **kwargs):
            forward = self.fn_ref.original_forward
            ctx = self.state._context
            name = ctx.name if ctx is not None else None
            if name not in ("cond", "uncond"):
                # Not inside a guidance pipeline's cond/uncond call (a direct call, a benchmark):
                # every rank computes it, which is what a single process would return.
                return forward(*args, **kwargs)
            return_dict = kwargs.get("return_dict", True)
            if name == "cond":
                if self.pending is not None:
                    self.pending = None
                    raise RuntimeError("cfg parallel: a 'cond' denoiser call came after a 'cond' call with no "
                                       "'uncond' call between; CFG parallel needs a pipeline that runs guidance "
                                       "(Wan: guidance_scale > 1; Flux: true_cfg_scale > 1 with a negative_prompt)")
                if self.branch == 0:
                    out = forward(*args, **kwargs)
                    self.pending, self.like = _sample(out), out
                    return out
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                # Filled in place (set_) at the uncond call's exchange; the pipeline combines the
                # two outputs only after that call, so nobody reads it before.
                self.pending = hidden.new_empty(0)
                return _wrap(self.pending, None, return_dict)
            if self.pending is None:
                raise RuntimeError("cfg parallel: an 'uncond' denoiser call without a 'cond' call before it; "
                                   "CFG parallel expects the cond forward first, as diffusers' pipelines call it")
            if self.branch == 1:
                out = forward(*args, **kwargs)
                mine = _sample(out).contiguous()
            else:
                out, mine = None, self.pending.contiguous()
            both = [torch.empty_like(mine) for _ in range(2)]
            torch.distributed.all_gather(both, mine, group=self.group)
            cond, uncond = both
            placeholder, self.pending = self.pending, None
            if self.branch == 1:
                if placeholder.dtype != cond.dtype:
                    raise RuntimeError(f"cfg parallel: the denoiser returns {cond.dtype} for {placeholder.dtype} "
                                       "inputs; run it in one dtype")
                placeholder.set_(cond)
                return out
            return _wrap(uncond, self.like, return_dict)

    return CfgParallelHook()


# -- sequence (context) parallel ----------------------------------------------------------------
def _split_view(t: Any) -> bool:
    """Whether `t` is laid out as a piece of a larger tensor (a sequence chunk): an offset
    into its storage or strides other than a fresh contiguous tensor's. Read from the layout,
    not from `t._base`: views made under inference_mode record no base."""
    if not isinstance(t, torch.Tensor):
        return False
    want, acc = [], 1
    for d in reversed(t.shape):
        want.append(acc)
        acc *= d
    return t.storage_offset() != 0 or tuple(reversed(want)) != t.stride()


def _make_fresh_hook(names: list[str]):
    _, _, ModelHook, _ = _hooks()

    class FreshInputsHook(ModelHook):
        """Makes the sequence-split inputs fresh tensors (not views of the full sequence), so
        a compiled block sees the same input kind at block 0 as at blocks 1..N-1."""

        def __init__(self):
            super().__init__()
            self.names = names
            self.index: dict[str, int] | None = None

        def initialize_hook(self, module):
            import inspect

            params = list(inspect.signature(type(module).forward).parameters)[1:]
            self.index = {n: params.index(n) for n in names if n in params}
            return module

        def pre_forward(self, module, *args, **kwargs):
            args = list(args)
            for n in self.names:
                if n in kwargs and _split_view(kwargs[n]):
                    kwargs[n] = kwargs[n].clone(memory_format=torch.contiguous_format)
                elif n in self.index and self.index[n] < len(args):
                    i = self.index[n]
                    if _split_view(args[i]):
                        # contiguous_format: a chunk keeps the full tensor's leading stride,
                        # which a static-shape compile guards on, like the view itself
                        args[i] = args[i].clone(memory_format=torch.contiguous_format)
            return tuple(args), kwargs

    return FreshInputsHook()


def _make_uneven_hook(degree: int, key: str):
    _, _, ModelHook, _ = _hooks()

    class UnevenRefusalHook(ModelHook):
        """Turns diffusers' bare assertion for a token count that does not divide by the
        sequence degree into an error that says what to do."""

        def new_forward(self, module, *args, **kwargs):
            try:
                return self.fn_ref.original_forward(*args, **kwargs)
            except AssertionError as e:
                if _SHARD_ASSERT not in str(e):
                    raise
                raise ValueError(
                    f"parallel {key!r}: this input's token count does not divide by the sequence-parallel degree "
                    f"{degree} (ulysses x ring); pick a resolution / frame count whose latent token count is a "
                    f"multiple of {degree}, or set uneven=true (diffusers' uneven shards)") from None

    return UnevenRefusalHook()


def _backend_name(model: nn.Module) -> str | None:
    """The attention backend the model's first attention processor dispatches to."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    for m in model.modules():
        proc = getattr(m, "processor", None)
        if proc is not None and hasattr(proc, "_attention_backend"):
            b = proc._attention_backend
            if b is None:
                b = _AttentionBackendRegistry.get_active_backend()[0]
            return getattr(b, "value", str(b))
    return None


# -- FA3 under context parallelism ------------------------------------------------------------------
def _fa3_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """Diffusers' context-parallel forward-op contract on the fa3 kernel (what Ulysses calls
    between its all-to-alls, and ring once per KV chunk, with return_lse=True)."""
    from .kernels import fa3

    return fa3.fa3_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)


def _fa3_backward_op(ctx, grad_out, *args, **kwargs):
    raise RuntimeError("attention backend 'fa3' has no backward under context parallelism (its cuDNN backward "
                       "is wired for one process only); train context-parallel with backend='native'")


def fa3_context_parallel_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                   enable_gqa=False, return_lse=False, _parallel_config=None):
    """The engine's fa3 backend, plus diffusers' templated Ulysses / ring around it when the
    layer carries a context-parallel config (diffusers' own backends are written the same way)."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    from .kernels import fa3

    if _parallel_config is None:
        return fa3.fa3_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)
    return _templated_context_parallel_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
        forward_op=_fa3_forward_op, backward_op=_fa3_backward_op, _parallel_config=_parallel_config)


def _fa3_cp_shim(member) -> Callable[[], None]:
    """Serve `member` (the slot the engine's fa3 kernel occupies) with
    `fa3_context_parallel_attention`, marked context-parallel capable; returns the undo that
    puts the registry entry back. The fa3 kernel module (another owner's) is left as it is."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as R

    saved = (R._backends.get(member), R._constraints.get(member), R._supported_arg_names.get(member),
             member.value in R._supports_context_parallel)
    R.register(member, constraints=list(saved[1] or []), supports_context_parallel=True)(
        fa3_context_parallel_attention)

    def undo() -> None:
        fn, constraints, names, was_cp = saved
        R._backends[member], R._constraints[member], R._supported_arg_names[member] = fn, constraints, names
        if not was_cp:
            R._supports_context_parallel.discard(member.value)

    return undo


def _engine_backend(model: nn.Module):
    """(member, function) when the model's attention dispatches to a function of this package
    (an engine kernel such as fa3), else (member or None, None)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry as R

    name = _backend_name(model)
    if name is None:
        return None, None
    member = AttentionBackendName(name)
    fn = R._backends.get(member)
    return member, (fn if getattr(fn, "__module__", "").startswith("magi_zoo.") else None)


def _check_sequence_parallel(model: nn.Module, spec: ParallelSpec, key: str) -> None:
    """Everything that would fail later inside diffusers, refused now with what to do."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    if not hasattr(model, "enable_parallelism") or getattr(model, "_cp_plan", None) is None:
        raise ValueError(f"parallel {key!r}: {type(model).__name__} has no context-parallel plan (diffusers' _cp_plan); "
                         "ulysses/ring cover diffusers transformers that declare one (Wan, Flux); use cfg=true "
                         "alone, or key the denoiser transformer")
    if torch.accelerator.device_count() == 0:
        raise ValueError(f"parallel {key!r}: diffusers' context parallelism runs on accelerators (it places rank r on "
                         "device r % device count, and there is none here); on CPU use cfg=true alone")
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if spec.ulysses_degree > 1 and heads and heads % spec.ulysses_degree and not spec.uneven:
        raise ValueError(f"parallel {key!r}: Ulysses splits the {heads} attention heads over {spec.ulysses_degree} "
                         f"ranks, which does not divide; use a ulysses_degree that divides {heads}, ring_degree "
                         "instead, or uneven=true")
    backend = _backend_name(model)
    _, engine_fn = _engine_backend(model)
    if engine_fn is not None and engine_fn is not fa3_context_parallel_attention:
        from .kernels import fa3

        if engine_fn is not fa3.fa3_attention:
            raise ValueError(f"parallel {key!r}: the engine's attention kernel in the {backend!r} slot "
                             f"({engine_fn.__name__}) has no context-parallel support; use bf16 fa3, '_native_cudnn' "
                             "or 'flash' with ulysses/ring (or cfg=true alone)")
    elif backend is not None:
        able = sorted(_AttentionBackendRegistry._supports_context_parallel)
        if backend not in able:
            raise ValueError(f"parallel {key!r}: attention backend {backend!r} has no context-parallel support in "
                             f"diffusers; set the attention section to one that has ({', '.join(able)}), e.g. "
                             "overrides={'attention': {KEY: '_native_cudnn'}}")
        if spec.ring_degree > 1 and backend == "native":
            raise ValueError(f"parallel {key!r}: ring attention merges partial results by their log-sum-exp, which "
                             "the 'native' (SDPA) backend does not return; use '_native_cudnn' or 'flash' for "
                             "ring_degree > 1, or ulysses_degree")


@contextlib.contextmanager
def _quiet_diffusers():
    """enable_parallelism logs an 'experimental feature' warning and, per call, a note for
    every input its plan does not split (Wan2.1's 1-D timestep): library noise the report
    replaces."""
    from diffusers.utils import logging as dlog

    old = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        dlog.set_verbosity(old)


def _quiet_cp_notices() -> None:
    """Drop two per-run notices of diffusers' context-parallel code users cannot act on
    (idempotent): the note that an input of the plan is not split (Wan2.1's 1-D timestep,
    which its plan splits only in Wan2.2's 2-D form) and torch's deprecation of the
    functional all-gather diffusers calls in its gather hook."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\._functional_collectives\.all_gather_tensor` "
                            r"is deprecated", category=FutureWarning)
    log = logging.getLogger("diffusers.hooks.context_parallel")
    if not any(type(f).__name__ == "_DropUnsplit" for f in log.filters):
        class _DropUnsplit(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                return "split will not be applied" not in record.getMessage()

        log.addFilter(_DropUnsplit())


def _fresh_entries(model: nn.Module) -> dict[str, list[str]]:
    """cp-plan submodules (compiled by the compile step) whose inputs diffusers splits:
    {module id: input names}."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    from .compile import installed

    out = {}
    for mid, entry in model._cp_plan.items():
        if not isinstance(entry, dict) or "*" in mid:
            continue
        names = [n for n, cpi in entry.items() if isinstance(n, str) and isinstance(cpi, ContextParallelInput)
                 and not cpi.split_output]
        sub = model.get_submodule(mid) if mid else model
        if names and ("", "forward") in installed(sub):
            out[mid] = names
    return out


def _sequence_parallel(model: nn.Module, spec: ParallelSpec, mesh, key: str) -> Callable[[], None]:
    """diffusers' enable_parallelism on `model` (plus the two hooks above); returns the undo."""
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import remove_context_parallel

    _, HookRegistry, _, _ = _hooks()
    had_registry = {id(m) for m in model.modules() if "_diffusers_hook" in m.__dict__}
    procs = [m.processor for m in model.modules() if hasattr(getattr(m, "processor", None), "_parallel_config")]
    prior_procs = [(p, p.__dict__.get("_parallel_config", _MISSING)) for p in procs]
    prior_model = model.__dict__.get("_parallel_config", _MISSING)
    fresh = _fresh_entries(model)
    cp_plan = model._cp_plan
    installed_cp = False
    forwards = _forwards(model.modules())

    def undo() -> None:
        root = HookRegistry.check_if_exists_or_initialize(model)
        root.remove_hook(UNEVEN_HOOK, recurse=False)
        if installed_cp:
            remove_context_parallel(model, cp_plan)
        for mid in fresh:
            sub = model.get_submodule(mid) if mid else model
            HookRegistry.check_if_exists_or_initialize(sub).remove_hook(FRESH_HOOK, recurse=False)
        for p, prior in prior_procs:
            _restore_attr(p, "_parallel_config", prior)
        _restore_attr(model, "_parallel_config", prior_model)
        _restore_forwards(forwards)
        for m in model.modules():
            if id(m) not in had_registry and "_diffusers_hook" in m.__dict__ and not m._diffusers_hook.hooks:
                del m.__dict__["_diffusers_hook"]
        for u in undo_shim:
            u()

    undo_shim: list[Callable[[], None]] = []
    member, engine_fn = _engine_backend(model)
    if engine_fn is not None and engine_fn is not fa3_context_parallel_attention:
        undo_shim.append(_fa3_cp_shim(member))  # checked above: the bf16 fa3 kernel
    try:
        for mid, names in fresh.items():  # before the split hooks: inside them, it sees the split
            sub = model.get_submodule(mid) if mid else model
            HookRegistry.check_if_exists_or_initialize(sub).register_hook(_make_fresh_hook(names), FRESH_HOOK)
        config = ContextParallelConfig(
            ulysses_degree=spec.ulysses_degree, ring_degree=spec.ring_degree, mesh=mesh,
            ulysses_anything=spec.uneven and spec.ulysses_degree > 1,
            ring_anything=spec.uneven and spec.ring_degree > 1)
        _quiet_cp_notices()
        with _quiet_diffusers():
            model.enable_parallelism(config=config)
        installed_cp = True
        if not spec.uneven:  # outermost: it must see the root's own split too
            HookRegistry.check_if_exists_or_initialize(model).register_hook(
                _make_uneven_hook(spec.sequence_degree, key), UNEVEN_HOOK)
    except BaseException:
        undo()
        raise
    return undo


_MISSING = object()


def _restore_attr(obj: Any, name: str, prior: Any) -> None:
    if prior is _MISSING:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = prior


def _forwards(modules) -> list[tuple[nn.Module, Any]]:
    """Each module's instance-level `forward` (or its absence). Diffusers' `remove_hook` puts
    back the forward it wrapped *as an instance attribute* even when there was none (the
    class method bound); restoring these makes the undo exact."""
    return [(m, m.__dict__.get("forward", _MISSING)) for m in modules]


def _restore_forwards(saved: list[tuple[nn.Module, Any]]) -> None:
    for m, prior in saved:
        _restore_attr(m, "forward", prior)


def _cfg_parallel(model: nn.Module, group, branch: int, key: str) -> Callable[[], None]:
    _, HookRegistry, _, _ = _hooks()
    if not hasattr(model, "cache_context"):
        raise ValueError(f"parallel {key!r}: cfg=true needs a diffusers model whose pipeline marks its cond/uncond "
                         f"calls with cache_context; {type(model).__name__} has none")
    had = "_diffusers_hook" in model.__dict__
    forwards = _forwards([model])
    registry = HookRegistry.check_if_exists_or_initialize(model)
    registry.register_hook(_make_cfg_hook(group, branch), CFG_HOOK)

    def undo() -> None:
        registry.remove_hook(CFG_HOOK, recurse=False)
        _restore_forwards(forwards)
        if not had and not registry.hooks:
            model.__dict__.pop("_diffusers_hook", None)

    return undo


# -- the step -----------------------------------------------------------------------------------
def _compiled_under(ctx: StepContext, path: str) -> list[str]:
    """Compile regions (enabled) at or under `path` in the plan just applied."""
    prefix = f"{path}." if path else ""
    return [r.name for r in ctx.regions if r.spec.enabled
            and any(m == path or m.startswith(prefix) for m in r.modules)]


def _check_device(model: nn.Module, key: str) -> None:
    """Each rank's weights on its own GPU (LOCAL_RANK): the usual mistake is loading before
    `distributed.init()` set the device, which puts every rank on cuda:0."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cuda":
        return
    mine = torch.cuda.current_device()
    if p.device.index != mine:
        raise ValueError(f"parallel {key!r}: this rank's weights are on cuda:{p.device.index} but its GPU is "
                         f"cuda:{mine}; call magi_zoo.distributed.init() (or torch.cuda.set_device(LOCAL_RANK)) "
                         "before loading the model")


def _job_fingerprint(ctx: StepContext) -> list:
    """What every rank must agree on: the resolved plan and the module tree's shape."""
    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in ctx.root.named_parameters()]
    return [ctx.profile.name, ctx.plan.digests(), distributed.digest(params)]


def parallel_step(ctx: StepContext) -> StepRecord:
    dist = torch.distributed
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if multi:  # before anything else, on every rank: mismatched ranks all fail here, together
        distributed.check_same(_job_fingerprint(ctx), "models or plans")
    section = ctx.plan.section("parallel")
    regions = [(key, ts) for (key, _), ts in section.regions().items() if ts[0].spec.active]
    world = dist.get_world_size() if multi else 1
    if not regions:
        did = "none requested" + (f" ({world} processes: each runs the whole model)" if world > 1 else "")
        return StepRecord("parallel", did, None, {"world_size": world})
    specs = {ts[0].spec for _, ts in regions}
    if len(specs) > 1:
        raise ValueError("parallel: regions ask for different degrees "
                         f"({'; '.join(f'{k}: {ts[0].spec.describe()}' for k, ts in regions)}); one job has one "
                         "device mesh, so give every parallel region the same degrees")
    spec: ParallelSpec = specs.pop()
    if not multi:
        raise ValueError(f"parallel ({spec.describe()}) needs {spec.degree} processes under torch.distributed; launch "
                         f"with `magi-zoo run ... --nproc {spec.degree}` or `torchrun --nproc-per-node {spec.degree} "
                         "...` and call magi_zoo.distributed.init() before loading")
    replicas = spec.check_world(world)
    mesh = distributed.device_mesh(spec.cfg_degree, spec.ring_degree, spec.ulysses_degree)
    branch = mesh.get_local_rank("cfg")
    undos: list[Callable[[], None]] = []
    done = []
    try:
        for key, targets in regions:
            for t in targets:
                _check_device(t.module, key)
                if spec.sequence_degree > 1:
                    _check_sequence_parallel(t.module, spec, key)
                if spec.uneven and _compiled_under(ctx, t.path):
                    # diffusers' uneven-shard attention exchanges the shard sizes with eager
                    # collectives (and splits all-to-alls by them) inside attention; dynamo cannot
                    # trace that (measured: the compiled block fails in a fake-tensor call).
                    raise ValueError(f"parallel {key!r}: uneven=true runs only in eager regions (its attention "
                                     f"exchanges shard sizes with collectives a compiled block cannot trace), and "
                                     f"{', '.join(_compiled_under(ctx, t.path)[:3])} is compiled; pick a shape whose "
                                     "token count divides by the degree, or fence the blocks off "
                                     "(compile {'<block class>': {'enabled': false}})")
            for t in targets:
                if spec.sequence_degree > 1:
                    undos.append(_sequence_parallel(t.module, spec, mesh, key))
                if spec.cfg:
                    undos.append(_cfg_parallel(t.module, mesh.get_group("cfg"), branch, key))
            where = targets[0].path if len(targets) == 1 else f"{len(targets)} x {targets[0].cls_name}"
            done.append(f"{key or '<root>'} ({where})")
    except BaseException:
        chain_undo(undos)()
        raise
    seq = []
    if spec.sequence_degree > 1:
        seq.append(f"attention backend {_backend_name(regions[0][1][0].module)}; splits and gathers in hooks "
                   "outside the compiled blocks, all-to-alls inside them as functional collectives")
    if spec.cfg:
        seq.append(f"this rank runs the {'cond' if branch == 0 else 'uncond'} branch")
    did = (f"{spec.describe()} over {world} processes"
           + (f" ({replicas} replicas)" if replicas > 1 else "") + f" on {', '.join(done)}; "
           + "; ".join(seq))
    details = {"world_size": world, "rank": dist.get_rank(), "ulysses_degree": spec.ulysses_degree,
               "ring_degree": spec.ring_degree, "cfg": spec.cfg, "uneven": spec.uneven, "replicas": replicas,
               "mesh": dict(zip(mesh.mesh_dim_names, mesh.mesh.shape)),
               "undo": "exact: hooks removed by name, the processors' and the model's _parallel_config, instance "
                       "forwards, hook registries and attention-registry entries put back; the device mesh's process "
                       "groups stay (process-level, reused by the next apply)"}
    return StepRecord("parallel", did, chain_undo(undos), {k: (list(v) if isinstance(v, tuple) else v)
                                                            for k, v in details.items()})


def cfg_parallel_active(plan: Any) -> bool:
    """Whether a resolved plan (None = nothing applied) splits CFG over processes: a
    pipeline call must then run guidance, which its adapter checks before generating."""
    if plan is None:
        return False
    return any(t.spec.cfg for t in plan.section("parallel").targets)
