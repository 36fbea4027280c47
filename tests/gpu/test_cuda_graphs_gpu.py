"""Every family whose Hopper plan serves the transformer's forward from CUDA graphs
(`[gpu.h100.cuda_graphs]` in its spec file), on a CUDA card (skipped without one): a whole
default call of its tiny variant with the graphs on equals the same plan with them off, on
the same weights, and the graphs' counters agree with the forwards the pipeline made.

The oracle is a forward pre-hook on the transformer, which sees every call the pipeline
makes whatever serves it: the graphs captured must be exactly the distinct input signatures
the hook saw (shapes, dtypes and plain values; one graph each), every call a replay, none
uncaptured."""

import pytest
import torch

import magi_zoo

pytestmark = pytest.mark.gpu

# The tiny variants of the families whose spec has a [gpu.h100.cuda_graphs] table; a family
# whose plan for the card at hand captures nothing is skipped, saying so.
GRAPHED = {"flux-tiny": dict(prompt="a red fox"),
           "flux.2-tiny": dict(prompt="a red fox"),
           "qwen-image-tiny": dict(prompt="a red fox"),  # true CFG: the prompt and the negative one
           "ltx-2-tiny": dict(prompt="a drum solo")}  # the CFG pair, the STG pass, the isolation pass
STEPS = 3


def _rel(a, b):
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    return float((a - b).norm() / b.norm())


def _signature(value):
    """What a graph is keyed by, read independently of the engine: the tree's tensors by
    shape and dtype, everything else by value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in sorted(value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    return repr(value)


def _outputs(out):
    """The pipeline output's arrays: images or frames, and the sound track where there is one."""
    return [getattr(out, k)[0] for k in ("images", "frames", "audio") if getattr(out, k, None) is not None]


@pytest.mark.parametrize("name", sorted(GRAPHED))
def test_whole_call_in_cuda_graphs_equals_the_uncaptured_call(name, fresh_dynamo):
    h = magi_zoo.load(name, gpu="auto")
    rep = h.report()
    calls = (rep.step("cuda_graphs").details or {}).get("graphed", {})
    if not calls:
        pytest.skip(f"the {rep.profile} plan of {name} captures no CUDA graphs")
    [graphed] = calls.values()
    plain = magi_zoo.load(name, gpu="auto", overrides={"cuda_graphs": {"transformer": False}})
    assert not (plain.report().step("cuda_graphs").details or {}).get("graphed")
    weights = h.modules.state_dict()
    with torch.no_grad():
        for k, t in plain.modules.state_dict().items():
            t.copy_(weights[k])

    seen: list = []
    hook = h.pipe.transformer.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(_signature((args, kwargs))), with_kwargs=True)
    call = dict(GRAPHED[name], output_type="np", num_inference_steps=STEPS)
    try:
        got = h(generator=torch.Generator().manual_seed(0), **call)
    finally:
        hook.remove()
    want = plain(generator=torch.Generator().manual_seed(0), **call)

    stats = graphed.stats()
    assert len(seen) >= STEPS, seen  # at least one forward a step went through the transformer
    assert (stats["graphs"], stats["replays"], stats["uncaptured"]) == (len(set(seen)), len(seen), {}), stats
    assert stats["graphs"] <= graphed.spec.max_graphs
    pairs = list(zip(_outputs(got), _outputs(want)))
    assert pairs and len(pairs) == len(_outputs(want))
    for a, b in pairs:
        assert _rel(a, b) < 1e-3, name
