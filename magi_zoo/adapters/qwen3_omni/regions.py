"""One code object per compiled class: why Qwen3-Omni needs it, the preparation, the check.

Dynamo keeps its compiled code on the *code object* of the frame it compiles: one cache
(with one recompile limit, 8 by default) per code object, and one verdict when a frame is
given up ("skip this code from now on"). `torch.compile(module.forward)` compiles the frame
of `type(module).forward.__code__`.

In transformers 5.x that code is usually not the model's own: `forward` is wrapped by
decorators (`merge_with_config_defaults` -> `capture_outputs`, `can_return_tuple`,
`deprecate_kwarg`, ...) whose `wrapper` is one code object for every class they decorate.
In Qwen3-Omni the audio and vision encoders, the thinker's text model, the talker's MoE
decoder (`talker.model`), the code predictor and Code2Wav's transformer all have
`forward.__code__` = `merge_with_config_defaults.<locals>.wrapper` (seen in 5.24). Compiled
as regions, they therefore shared one dynamo cache, and that broke the speech path:

- the encoders graph-break inside `capture_outputs`' try/finally (at the output hooks'
  `ContextVar.get`); dynamo cannot resume inside a try block, so it gives up the shared
  wrapper frame and runs it eagerly from then on -- for *every* region that starts with it.
  The talker's next compile then began one frame deeper, with the output collector already
  set eagerly, and `fullgraph=True` turned the `ContextVar.get` there into `Unsupported`;
- with the encoders eager, the talker and the code predictor still shared 8 cache entries,
  and a second speech call hit `FailOnRecompileLimitHit`.

The fix is to compile at a level where the code is distinct: `own_code_preparation` gives
every module whose class shares its `forward` code with another class a `forward` of its
own -- a one-line function calling the library's forward, whose code object is made once
per class (named `<Class>_forward`, so dynamo's messages name the region). Instances of one
class still share one code object on purpose: that is regional compilation (block 1..N-1
reuse block 0's graph). `shared_code_regions` is the check: compiled regions of different
classes that still start in one code object (a method the preparation does not cover, a
new transformers wrapper); the pipeline refuses to run such a plan and names the regions.
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Callable

import torch.nn as nn

from ...engine import Preparation, installed, instance_forwards

_OWN_FORWARDS: dict[type, Callable] = {}  # class -> its forward with a private code object (made once)


def _library_code(fn: Callable):
    """The code object dynamo compiles for a method (a function or a bound method)."""
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__code__", None)


def own_forward(cls: type) -> Callable:
    """`cls.forward` behind a function whose code object belongs to `cls` alone.

    `code.replace` makes a new code object (dynamo keys its cache on identity); the name
    `<Class>_forward` is what dynamo prints in recompile and break messages. Cached per
    class, so re-applying a plan finds dynamo's earlier compiles of the same code."""
    if cls not in _OWN_FORWARDS:
        _OWN_FORWARDS[cls] = make_own_forward(cls)
    return _OWN_FORWARDS[cls]


def make_own_forward(cls: type) -> Callable:
    """A new function calling `cls.forward`, with a new code object (uncached: `own_forward`
    is what the preparation uses; this is for a comparison that needs a never-compiled copy)."""
    library_forward = cls.forward

    def forward(self, *args, **kwargs):
        return library_forward(self, *args, **kwargs)

    name = f"{cls.__name__}_forward"
    code = forward.__code__
    fields = {"co_name": name}
    if hasattr(code, "co_qualname"):  # Python >= 3.11
        fields["co_qualname"] = name
    forward.__code__ = code.replace(**fields)
    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"{cls.__name__}.forward with a code object of its own (see regions.py)."
    forward.__wrapped__ = library_forward  # type: ignore[attr-defined]
    return forward


def _compiled_code(mod: nn.Module, method: str):
    """The code object of the frame a compiled method's region starts in: the engine's
    wrapper wraps `torch.compile(bound method)`, and both keep what they wrap as
    `__wrapped__` (functools.wraps); the bound method underneath is the preparation's own
    forward or the class's method."""
    fn = mod.__dict__.get(method)
    for _ in range(4):  # engine wrapper -> compiled function -> bound method
        if fn is None or isinstance(fn, types.MethodType):
            break
        fn = getattr(fn, "__wrapped__", None)
    return _library_code(fn) if isinstance(fn, types.MethodType) else None


def shared_forward_classes(root: nn.Module) -> dict[type, list[type]]:
    """Classes under `root` whose `forward` code object another class under `root` shares
    (torch's `_forward_unimplemented` placeholder excluded: such modules are never called).
    Returns class -> the other classes sharing its code."""
    by_code: dict[object, set[type]] = defaultdict(set)
    for mod in root.modules():
        code = _library_code(type(mod).forward)
        if code is not None and code.co_name != "_forward_unimplemented":
            by_code[code].add(type(mod))
    return {cls: sorted(others - {cls}, key=lambda c: c.__name__)
            for others in by_code.values() if len(others) > 1 for cls in others}


def own_code_preparation(model: nn.Module) -> Preparation:
    """The preparation: every module whose class shares `forward` code with another class
    gets an instance `forward` with its class's own code object; undone by deleting it."""

    def install(root: nn.Module):
        shared = shared_forward_classes(model)
        # the instance forward is also what the compile step replaces and later restores
        return instance_forwards([m for m in model.modules() if type(m) in shared and "forward" not in m.__dict__],
                                 lambda m: types.MethodType(own_forward(type(m)), m))

    return Preparation("one code object per class",
                       "modules whose class shares its forward's code with other classes (transformers' "
                       "decorator wrappers) get a forward with code of their own, so every compiled class has "
                       "its own dynamo cache, recompile limit and skip verdict", install)


def shared_code_regions(root: nn.Module) -> list[str]:
    """The check: one line per code object that compiled regions of different classes start
    in (empty when every compiled class has code of its own). Regions are read from the
    compiled methods installed under `root`; the code is the one their frame runs."""
    by_code: dict[object, list[str]] = defaultdict(list)
    classes: dict[object, set[str]] = defaultdict(set)
    for path, method in installed(root):
        mod = root.get_submodule(path)
        code = _compiled_code(mod, method)
        if code is None:
            continue
        by_code[code].append(f"{path or '<root>'}.{method} ({type(mod).__name__})")
        classes[code].add(type(mod).__name__)
    return [f"{', '.join(regions)} all start in {code.co_name} ({code.co_filename}:{code.co_firstlineno})"
            for code, regions in by_code.items() if len(classes[code]) > 1]


def check_distinct_code(root: nn.Module) -> None:
    """Raise if compiled regions of different classes share a code object (see module doc)."""
    shared = shared_code_regions(root)
    if shared:
        raise RuntimeError(
            "compile regions of different classes share one code object, hence one dynamo cache, "
            "recompile limit and skip verdict (a graph break in one changes how the others compile): "
            + "; ".join(shared)
            + ". Compile a method with code of its own (for `forward`, Qwen3OmniAdapter.preparations gives "
              "each class one), or compile their common parent instead.")
