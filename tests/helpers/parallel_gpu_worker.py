"""One rank of the multi-GPU check in tests/test_parallel_gpu.py; run under torchrun with 2 (or 4)
GPUs. Rank 0 writes JSON to argv[1].

Per configuration, every rank computes the single-GPU reference itself (the same plan -- the
shipped spec for the card, regional compile, the same attention backend -- without the
parallel section), then applies the parallel plan and compares the output (bf16: relative
L2), counting compiles, graph breaks and recompiles of the blocks, and checks the undo.

`argv[2] == "cpu"` runs the Ulysses configuration on CPU (gloo, wan2.1-tiny, one stand-in
device for diffusers' device pick): how this script itself is checked without a GPU.
`argv[3]`, optional, names the configurations to run (comma-separated, e.g. `cfg`); all by default.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from magi_zoo import distributed

out_path = sys.argv[1]
on_cpu = len(sys.argv) > 2 and sys.argv[2] == "cpu"
distributed.init("cpu" if on_cpu else "cuda")
rank, world = distributed.rank(), distributed.world_size()

import magi_zoo  # noqa: E402
from magi_zoo.engine import counters, remove  # noqa: E402
from magi_zoo.overrides import spec_layers  # noqa: E402

if on_cpu:
    torch.accelerator.device_count = lambda: 1
    model, gpu, weights, shape, odd = "wan2.1-tiny", "cpu", None, {}, dict(height=48, width=48, frames=1)
else:
    # 240x400: 15 x 25 latent patches per frame; 9 frames -> 3 latent frames: 1,125 tokens
    # (divides by 1, 3, 5 -- not 2: refused unless uneven); 17 frames -> 5: 1,875; the even
    # shape is 240x416x17 (15 x 26 x 5 = 1,950 tokens).
    model, gpu, weights = "wan2.1-t2v-1.3b", "auto", "random"
    shape, odd = dict(height=240, width=416, frames=17), dict(height=240, width=400, frames=9)
h = magi_zoo.load(model, gpu=gpu, weights=weights, compile=False)
t = h.pipe.transformer
attn_key = "WanTransformer3DModel"
result: dict = {"world": world, "model": model, "configs": []}


def rel(a, b):
    return float((a - b).norm() / b.norm())


def forward(**s):
    kw = h.adapter.example_inputs(h.pipe, h.variant, "denoise", **s)
    with torch.inference_mode():
        return t(**kw)[0].float()


CFG_GAP: list[float] = []  # |c - u| / |c| of each cfg_step call


def cfg_step(**s):
    kw = h.adapter.example_inputs(h.pipe, h.variant, "denoise", **s)
    # The negated context: a really different condition. (Rolling the tokens by one, as this
    # did before, changes nothing -- cross-attention does not see key order -- so c - u was
    # rounding noise that guidance 5 amplified into a 3e-2 "error".)
    neg = dict(kw, encoder_hidden_states=-kw["encoder_hidden_states"])
    with torch.inference_mode():
        with t.cache_context("cond"):
            c = t(**kw)[0]
        with t.cache_context("uncond"):
            u = t(**neg)[0]
        CFG_GAP.append(rel(c.float(), u.float()))
        return (u + 5.0 * (c - u)).float(), c.float(), u.float()  # guided, and each branch


def state(module):
    """What an exact undo gives back. An empty diffusers hook registry is left out: the model's
    own `cache_context` (cfg_step calls it) creates one at the first call."""
    def keys(m):
        hooks = m.__dict__.get("_diffusers_hook")
        return sorted(k for k in m.__dict__ if k in ("forward", "_parallel_config")
                      or (k == "_diffusers_hook" and hooks.hooks))

    return [(n, keys(m)) for n, m in module.named_modules()]




def check(name, parallel, attention=None, fn=forward, s=None, compile=None):
    s = shape if s is None else s
    over = {"parallel": {attn_key: parallel}}
    if attention:
        over["attention"] = {attn_key: attention}
    layers = spec_layers(h.adapter, h.profile, compile=compile,
                         overrides={"attention": over["attention"]} if attention else None)
    before = state(h.modules)
    torch.compiler.reset()
    magi_zoo.apply(h.modules, layers=layers, gpu=h.profile)
    ref = fn(**s)
    remove(h.modules)
    torch.compiler.reset()
    layers = spec_layers(h.adapter, h.profile, compile=compile, overrides=over)
    snap = counters.snapshot()
    rep = magi_zoo.apply(h.modules, layers=layers, gpu=h.profile)
    row = {"name": name}
    try:
        got = fn(**s)
        got = fn(**s)  # a second call: no recompile
        d = counters.delta(snap)
        if isinstance(got, tuple):  # cfg_step: the guided output, then the cond and uncond branches
            row.update(rel_l2_cond=rel(got[1], ref[1]), rel_l2_uncond=rel(got[2], ref[2]))
            got, ref = got[0], ref[0]
        row.update(rel_l2=rel(got, ref), frames=d.frames, graphs=d.graphs, breaks=d.graph_breaks,
                   recompiles=d.recompiles, did=next(x.did for x in rep.steps if x.step == "parallel"))
    except Exception as e:  # noqa: BLE001 - recorded for the test to show
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    remove(h.modules)
    row["undo_exact"] = state(h.modules) == before
    if fn is cfg_step:
        row["cond_uncond_gap"] = min(CFG_GAP)
    result["configs"].append(row)


only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None  # e.g. "cfg": one configuration


def wanted(name):
    return only is None or name in only


if wanted("ulysses"):
    check("ulysses", {"ulysses_degree": 2})
if not on_cpu and only is not None:
    if wanted("cfg"):
        check("cfg", {"cfg": True}, fn=cfg_step)
elif not on_cpu:
    check("ring", {"ring_degree": 2}, attention="_native_cudnn")
    check("ring_fa3", {"ring_degree": 2})
    # uneven shards run eager (the engine refuses them inside compiled blocks)
    check("uneven", {"ulysses_degree": 2, "uneven": True}, attention="_native_cudnn", s=odd,
          compile={"WanTransformerBlock": {"enabled": False}})
    check("cfg", {"cfg": True}, fn=cfg_step)
    if world >= 4:
        check("cfg_ulysses", {"cfg": True, "ulysses_degree": 2}, fn=cfg_step)

if rank == 0:
    with open(out_path, "w") as f:
        json.dump(result, f)
distributed.shutdown()
os._exit(0)
