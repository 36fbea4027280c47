"""Sequence (context) parallelism, Ulysses / ring: diffusers' own, installed per region.

``model.enable_parallelism(ContextParallelConfig(...))`` registers hooks from the model's
context-parallel plan that split inputs along the sequence (e.g. Wan: ``blocks.0``'s
``hidden_states``, the RoPE tables) and all-gather the output (``proj_out``), and gives every
self-attention processor the config, so attention dispatch runs Ulysses all-to-alls or the ring
around the kernel. Why that composes with regional compile here and not in diffusers'
``compile_repeated_blocks`` (docs/multi-gpu.md: that fails tracing the hook's
``inspect.signature``): our compile step replaces the block's *forward*, and a diffusers hook
installed afterwards wraps that compiled forward from outside -- the split/gather hooks run
eagerly, and inside the compiled block only the attention's collectives remain, which diffusers
writes as functional collectives (``funcol.all_to_all_single``) that dynamo traces into the
graph (no graph break; tests count them). One adjustment: the split hands block 0 a *view* of
the full sequence, where blocks 1..N-1 get fresh tensors; dynamo then guards on the view's
storage offset and compiles block 0 twice, so a hook inside the split makes that input a fresh
tensor (one copy of 1/N of the hidden states per forward) and all blocks share one compile again.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

from ...specs.parallel_spec import ParallelSpec
from ..compat import diffusers as diffusers_compat
from ..compile import installed
from ..kernels import fa3
from .fa3_cp import fa3_context_parallel_attention, serve_fa3_context_parallel
from .hooks import (drop_empty_registry, forwards, has_registry, hook_classes, instance_attr, registry,
                    restore_attr, restore_forwards)

UNEVEN_HOOK = "magi_zoo_cp_uneven_refusal"
FRESH_HOOK = "magi_zoo_cp_fresh_inputs"
_SHARD_ASSERT = "must be divisible by mesh size"  # diffusers' EquipartitionSharder assertion text


def _split_view(t: Any) -> bool:
    """Whether `t` is laid out as a piece of a larger tensor (a sequence chunk): an offset
    into its storage or strides other than a fresh contiguous tensor's. Read from the layout,
    not from the tensor's base: views made under inference_mode record no base."""
    if not isinstance(t, torch.Tensor):
        return False
    want, acc = [], 1
    for d in reversed(t.shape):
        want.append(acc)
        acc *= d
    return t.storage_offset() != 0 or tuple(reversed(want)) != t.stride()


def _make_fresh_hook(names: list[str]):
    _, _, ModelHook, _ = hook_classes()

    class FreshInputsHook(ModelHook):
        """Makes the sequence-split inputs fresh tensors (not views of the full sequence), so
        a compiled block sees the same input kind at block 0 as at blocks 1..N-1."""

        def __init__(self):
            super().__init__()
            self.names = names
            self.index: dict[str, int] | None = None

        def initialize_hook(self, module):
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
    _, _, ModelHook, _ = hook_classes()

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


def backend_name(model: nn.Module) -> str | None:
    """The attention backend the model's first attention processor dispatches to."""
    for m in model.modules():
        proc = getattr(m, "processor", None)
        if diffusers_compat.has_backend_slot(proc):
            b = diffusers_compat.processor_backend(proc)
            if b is None:
                b = diffusers_compat.active_backend()
            return getattr(b, "value", str(b))
    return None


def engine_backend(model: nn.Module):
    """(member, function) when the model's attention dispatches to a function of this package
    (an engine kernel such as fa3), else (member or None, None)."""
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers.models.attention_dispatch import AttentionBackendName

    name = backend_name(model)
    if name is None:
        return None, None
    member = AttentionBackendName(name)
    fn = diffusers_compat.registered_backend(member)
    return member, (fn if getattr(fn, "__module__", "").startswith("magi_zoo.") else None)


def check_sequence_parallel(model: nn.Module, spec: ParallelSpec, key: str) -> None:
    """Everything that would fail later inside diffusers, refused now with what to do."""
    if not hasattr(model, "enable_parallelism") or diffusers_compat.cp_plan(model) is None:
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
    backend = backend_name(model)
    _, engine_fn = engine_backend(model)
    if engine_fn is not None and engine_fn is not fa3_context_parallel_attention:
        if engine_fn is not fa3.fa3_attention:
            raise ValueError(f"parallel {key!r}: the engine's attention kernel in the {backend!r} slot "
                             f"({engine_fn.__name__}) has no context-parallel support; use bf16 fa3, '_native_cudnn' "
                             "or 'flash' with ulysses/ring (or cfg=true alone)")
    elif backend is not None:
        able = sorted(diffusers_compat.context_parallel_backends())
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
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers.utils import logging as dlog

    old = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        dlog.set_verbosity(old)


class _DropUnsplit(logging.Filter):
    """Drops diffusers' note that an input of the context-parallel plan is not split."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "split will not be applied" not in record.getMessage()


def _quiet_cp_notices() -> None:
    """Drop two per-run notices of diffusers' context-parallel code users cannot act on
    (idempotent): the note that an input of the plan is not split (Wan2.1's 1-D timestep,
    which its plan splits only in Wan2.2's 2-D form) and torch's deprecation of the
    functional all-gather diffusers calls in its gather hook."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\._functional_collectives\.all_gather_tensor` "
                            r"is deprecated", category=FutureWarning)
    log = logging.getLogger("diffusers.hooks.context_parallel")
    if not any(isinstance(f, _DropUnsplit) for f in log.filters):
        log.addFilter(_DropUnsplit())


def _fresh_entries(model: nn.Module) -> dict[str, list[str]]:
    """cp-plan submodules (compiled by the compile step) whose inputs diffusers splits:
    {module id: input names}."""
    out = {}
    for mid, names in diffusers_compat.cp_split_inputs(model).items():
        sub = model.get_submodule(mid) if mid else model
        if ("", "forward") in installed(sub):
            out[mid] = names
    return out


def sequence_parallel(model: nn.Module, spec: ParallelSpec, mesh, key: str) -> Callable[[], None]:
    """diffusers' enable_parallelism on `model` (plus the two hooks above); returns the undo."""
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers import ContextParallelConfig
    from diffusers.hooks.context_parallel import remove_context_parallel  # lazy: as above

    config_attr = diffusers_compat.PARALLEL_CONFIG_ATTR
    had_registry = {id(m) for m in model.modules() if has_registry(m)}
    procs = [m.processor for m in model.modules() if hasattr(getattr(m, "processor", None), config_attr)]
    prior_procs = [(p, instance_attr(p, config_attr)) for p in procs]
    prior_model = instance_attr(model, config_attr)
    fresh = _fresh_entries(model)
    cp_plan = diffusers_compat.cp_plan(model)
    installed_cp = False
    saved_forwards = forwards(model.modules())

    def undo() -> None:
        registry(model).remove_hook(UNEVEN_HOOK, recurse=False)
        if installed_cp:
            remove_context_parallel(model, cp_plan)
        for mid in fresh:
            sub = model.get_submodule(mid) if mid else model
            registry(sub).remove_hook(FRESH_HOOK, recurse=False)
        for p, prior in prior_procs:
            restore_attr(p, config_attr, prior)
        restore_attr(model, config_attr, prior_model)
        restore_forwards(saved_forwards)
        for m in model.modules():
            if id(m) not in had_registry:
                drop_empty_registry(m)
        for u in undo_shim:
            u()

    undo_shim: list[Callable[[], None]] = []
    member, engine_fn = engine_backend(model)
    if engine_fn is not None and engine_fn is not fa3_context_parallel_attention:
        undo_shim.append(serve_fa3_context_parallel(member))  # checked above: the bf16 fa3 kernel
    try:
        for mid, names in fresh.items():  # before the split hooks: inside them, it sees the split
            sub = model.get_submodule(mid) if mid else model
            registry(sub).register_hook(_make_fresh_hook(names), FRESH_HOOK)
        config = ContextParallelConfig(
            ulysses_degree=spec.ulysses_degree, ring_degree=spec.ring_degree, mesh=mesh,
            ulysses_anything=spec.uneven and spec.ulysses_degree > 1,
            ring_anything=spec.uneven and spec.ring_degree > 1)
        _quiet_cp_notices()
        with _quiet_diffusers():
            model.enable_parallelism(config=config)
        installed_cp = True
        if not spec.uneven:  # outermost: it must see the root's own split too
            registry(model).register_hook(_make_uneven_hook(spec.sequence_degree, key), UNEVEN_HOOK)
    except BaseException:
        undo()
        raise
    return undo
