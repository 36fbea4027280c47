"""One rank of the 2-process CPU (gloo) check in tests/test_parallel.py; run under torchrun.

Every rank builds wan2.1-tiny (fp32, CPU), computes the single-process reference itself
(the plan without a parallel section: each rank alone), then applies parallel plans and
compares. Rank 0 writes what it saw as JSON to the path in argv[1]; the test asserts.

Diffusers' context parallelism places rank r on device ``r % torch.accelerator.
device_count()``, which is 0 on a CPU-only build; the engine refuses that with a clear error
(checked here first), and the Ulysses checks below then stand in a count of 1 so diffusers'
own Ulysses path (all-to-all over gloo) runs on CPU.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from magi_zoo import distributed

out_path = sys.argv[1]
distributed.init("cpu")
rank = distributed.rank()
result: dict = {"world": distributed.world_size()}

import magi_zoo  # noqa: E402
from magi_zoo.engine import counters, remove  # noqa: E402

h = magi_zoo.load("wan2.1-tiny", gpu="cpu", dtype="float32", compile=False)
t = h.pipe.transformer
call = dict(h.call_defaults(), prompt="a corgi", output_type="np")


def frames():
    return h.pipe(**call, generator=torch.Generator().manual_seed(3)).frames


def forward(**shape):
    kw = h.adapter.example_inputs(h.pipe, h.variant, "denoise", **shape)
    with torch.no_grad():
        return t(**kw)[0]


def state(module):
    """What the parallel step may touch: instance attributes and hooks of every submodule."""
    return [(n, sorted(k for k in m.__dict__ if k in ("forward", "_diffusers_hook", "_parallel_config")),
             getattr(getattr(m, "processor", None), "_parallel_config", None) is not None)
            for n, m in module.named_modules()]


def cfg_split(modules, generate, ref, block, steps: int) -> dict:
    """`generate()` under CFG parallel (eager) against `ref`, one process's output: the largest
    difference, the calls of `block` meanwhile (`steps` when each rank runs one branch a step),
    the parallel step's report line; the plan removed after."""
    rep = magi_zoo.apply(modules, {"compile": {"": {"enabled": False}}, "parallel": {"transformer": {"cfg": True}}},
                         gpu="cpu")
    calls = []
    hook = block.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        got = generate()
    finally:
        hook.remove()
        remove(modules)
    return {"did": next(s for s in rep.steps if s.step == "parallel").did, "max_diff": float(abs(got - ref).max()),
            "block0_calls": len(calls), "steps": steps}


ref_frames, ref_fwd = frames(), forward()
before = state(h.modules)
eager_compile = {"WanTransformerBlock": {"backend": "eager", "fullgraph": True, "dynamic": False}}

# 1. CFG parallel: each rank one branch, outputs exchanged. Must equal one process exactly.
result["cfg"] = cfg_split(h.modules, frames, ref_frames, t.blocks[0], call["num_inference_steps"])
result["cfg"]["undo_exact"] = state(h.modules) == before

# 2. Ulysses on CPU is refused with a clear error ...
try:
    magi_zoo.apply(h.modules, {"compile": {"": {"enabled": False}}, "parallel": {"transformer": {"ulysses_degree": 2}}},
                   gpu="cpu")
    result["cpu_refusal"] = None
except ValueError as e:
    result["cpu_refusal"] = str(e)
result["cpu_refusal_undo_exact"] = state(h.modules) == before

# ... and runs with diffusers' device pick given one device (see the module docstring), with the
# blocks compiled (fullgraph, backend eager: counting graphs, not generating code).
torch.accelerator.device_count = lambda: 1
torch.compiler.reset()
snap = counters.snapshot()
rep = magi_zoo.apply(h.modules, {"compile": eager_compile, "parallel": {"transformer": {"ulysses_degree": 2}}},
                     gpu="cpu")
fwd = forward()
d = counters.delta(snap)
# Under inference_mode (benchmarks, users) from a clean cache (inference tensors compile
# their own graph): views made there carry no `_base`, so the split input is recognised by
# its layout, not by being a view -- still one compile for all blocks, two calls.
torch.compiler.reset()
snap_inf = counters.snapshot()
with torch.inference_mode():
    kw_inf = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    fwd_inference = t(**kw_inf)[0]
    fwd_inference = t(**kw_inf)[0]
d_inf = counters.delta(snap_inf)
result["ulysses_inference"] = {"fwd_max_diff": float((fwd_inference - ref_fwd).abs().max()),
                               "compiled_frames": d_inf.frames, "graphs": d_inf.graphs,
                               "breaks": d_inf.graph_breaks, "recompiles": d_inf.recompiles}
got = frames()
rec = next(s for s in rep.steps if s.step == "parallel")
result["ulysses"] = {"did": rec.did, "fwd_max_diff": float((fwd - ref_fwd).abs().max()),
                     "frames_max_diff": float(abs(got - ref_frames).max()), "compiled_frames": d.frames,
                     "graphs": d.graphs, "breaks": d.graph_breaks, "recompiles": d.recompiles}
try:  # 1 x 3 x 3 = 9 latent tokens: not divisible by 2
    forward(height=48, width=48, frames=1)
    result["uneven_refusal"] = None
except ValueError as e:
    result["uneven_refusal"] = str(e)
remove(h.modules)
result["ulysses"]["undo_exact"] = state(h.modules) == before
# The engine's fa3 kernel (CUDA only) under Ulysses: served through diffusers' templated
# context-parallel attention by the step. Here a stand-in with fa3's contract (SDPA inside)
# takes its place in the registry, so the wiring and its undo run on CPU.
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry as R  # noqa: E402

from magi_zoo.engine.kernels import fa3  # noqa: E402

member = AttentionBackendName._FLASH_3
saved_entry = (R._backends.get(member), member.value in R._supports_context_parallel)


def fake_fa3(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
             return_lse=False, _parallel_config=None):
    assert _parallel_config is None  # fa3's own refusal; the step must route around it
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)


fake_fa3.__module__ = fa3.__name__
real_fa3, fa3.fa3_attention = fa3.fa3_attention, fake_fa3
R.register(member)(fake_fa3)
procs = [m.processor for m in t.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]
for p in procs:
    p._attention_backend = member
rep = magi_zoo.apply(h.modules, {"compile": eager_compile, "parallel": {"transformer": {"ulysses_degree": 2}}},
                     gpu="cpu")
result["fa3"] = {"fwd_max_diff": float((forward() - ref_fwd).abs().max()),
                 "cp_entry": R._backends[member].__name__, "did": next(x.did for x in rep.steps if x.step == "parallel")}
remove(h.modules)
result["fa3"]["entry_restored"] = R._backends[member] is fake_fa3 and (member.value in R._supports_context_parallel) \
    == saved_entry[1]
for p in procs:
    p._attention_backend = None
fa3.fa3_attention = real_fa3
if saved_entry[0] is not None:
    R._backends[member] = saved_entry[0]

try:  # uneven shards exchange sizes with collectives dynamo cannot trace: refused in compiled blocks
    magi_zoo.apply(h.modules, {"compile": eager_compile,
                               "parallel": {"transformer": {"ulysses_degree": 2, "uneven": True}}}, gpu="cpu")
    result["uneven_compiled_refusal"] = None
except ValueError as e:
    result["uneven_compiled_refusal"] = str(e)
result["uneven_compiled_undo_exact"] = state(h.modules) == before

# 3. Flux: Ulysses splits its joint (text + image) sequence at the root, the two block classes
# compile once each; true CFG (negative prompt, true_cfg_scale > 1) splits like Wan's CFG.
torch.compiler.reset()
f = magi_zoo.load("flux-tiny", gpu="cpu", dtype="float32", compile=False)
fkw = f.adapter.example_inputs(f.pipe, f.variant, "denoise")
with torch.no_grad():
    fref = f.pipe.transformer(**fkw)[0]
fcall = dict(f.call_defaults(), prompt="a corgi", negative_prompt="blurry", true_cfg_scale=4.0, output_type="np")
fimg = f.pipe(**fcall, generator=torch.Generator().manual_seed(1)).images
flux_compile = {c: {"backend": "eager", "fullgraph": True, "dynamic": False}
                for c in ("FluxTransformerBlock", "FluxSingleTransformerBlock")}
snap = counters.snapshot()
magi_zoo.apply(f.modules, {"compile": flux_compile, "parallel": {"transformer": {"ulysses_degree": 2}}},
               gpu="cpu", preparations=f.adapter.preparations(f.pipe))
with torch.no_grad():
    fout = f.pipe.transformer(**fkw)[0]
    fout = f.pipe.transformer(**fkw)[0]
d = counters.delta(snap)
remove(f.modules)
magi_zoo.apply(f.modules, {"compile": {"": {"enabled": False}}, "parallel": {"transformer": {"cfg": True}}}, gpu="cpu")
result["flux"] = {"fwd_max_diff": float((fout - fref).abs().max()), "frames": d.frames, "breaks": d.graph_breaks,
                  "recompiles": d.recompiles,
                  "cfg_max_diff": float(abs(f.pipe(**fcall, generator=torch.Generator().manual_seed(1)).images
                                            - fimg).max())}
remove(f.modules)

# 3b. FLUX.2 [klein] base (Flux2KleinPipeline, guidance_scale > 1, not distilled): its cond /
# uncond calls split like Wan's, each rank one branch.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: torchrun runs this file
from helpers import flux2_klein_tiny  # noqa: E402

k_adapter, k_variant = flux2_klein_tiny()
k_pipe = k_adapter.build(k_variant, weights="random", dtype=torch.float32, device=torch.device("cpu"))
kcall = dict(k_variant.call_defaults, prompt="a corgi", output_type="np")


def klein_image():
    return k_pipe(**kcall, generator=torch.Generator().manual_seed(2)).images


result["klein"] = dict(cfg_split(torch.nn.ModuleDict(k_adapter.components(k_pipe)), klein_image, klein_image(),
                                 k_pipe.transformer.transformer_blocks[0], kcall["num_inference_steps"]),
                       runs_cfg=k_adapter.runs_cfg(kcall, k_variant))

# 3c. HunyuanVideo-1.5: its guider component names the calls "pred_cond" / "pred_uncond".
hv = magi_zoo.load("hunyuanvideo-1.5-tiny", gpu="cpu", dtype="float32", compile=False)
hvcall = dict(hv.call_defaults(), prompt="a corgi", output_type="np")


def hv_frames():
    return hv.pipe(**hvcall, generator=torch.Generator().manual_seed(4)).frames


result["hunyuan"] = dict(cfg_split(hv.modules, hv_frames, hv_frames(), hv.pipe.transformer.transformer_blocks[0],
                                   hvcall["num_inference_steps"]), runs_cfg=hv.adapter.runs_cfg(hvcall, hv.variant))

# 4. Ranks that disagree are told so, on every rank, before any work.
try:
    distributed.check_same({"steps": 10 + rank}, "command lines")
    result["mismatch"] = None
except ValueError as e:
    result["mismatch"] = str(e)

if rank == 0:
    with open(out_path, "w") as f:
        json.dump(result, f)
distributed.shutdown()
os._exit(0)
