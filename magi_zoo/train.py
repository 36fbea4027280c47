"""Training with magi_zoo: the pieces `load(..., train=True)` and the training benchmark use
(library code: the training plan's layers come from `magi_zoo.overrides`, and nothing here
loads a model or reads a command line).

    handle = magi_zoo.load("wan2.1", train=True, recompute={"policy": "auto", "train_peak_gib": 16})
    model = handle.trainable            # the denoiser, in train mode, plan applied
    loss = flow_matching_loss(model, handle.adapter.example_inputs(handle.pipe, handle.variant, "denoise"))
    loss.backward()

- `set_train_mode`: the denoiser in train mode with gradients, the other components (text
  encoders, VAE) frozen in eval mode, as a fine-tune runs them;
- `calibrate`: measures the `auto` regions on the denoiser's example inputs;
- `flow_matching_loss`: rectified-flow loss on given latents (what Wan and Flux train with);
- `shard`: FSDP2 (`torch.distributed.fsdp.fully_shard`) per block, then the root, after the
  plan is applied -- torchtitan's order: recompute -> compile -> shard.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .engine.compile import compiled_methods
from .engine.recompute import calibrate as calibrate_module
from .engine.recompute import recompute_state


def trainable_module(adapter, native) -> nn.Module:
    """The module a fine-tune trains: the family's first entry point's module (the denoiser)."""
    if not adapter.entry_points:
        raise ValueError(f"{adapter.family} declares no entry point, so nothing to train; train=True needs one")
    return adapter.entry(native, adapter.entry_points[0])[0]


def set_train_mode(adapter, native) -> nn.Module:
    """Train mode + gradients on the denoiser; every other component eval and frozen."""
    model = trainable_module(adapter, native)
    for comp in adapter.components(native).values():
        if comp is not model:
            comp.eval().requires_grad_(False)
    model.train().requires_grad_(True)
    return model


def calibrate(handle, **shape) -> list[dict[str, Any]]:
    """Measure the `auto` recompute regions of a train handle on the denoiser's example
    inputs (at `shape`, default the variant's call size) and make the per-block choice."""
    entry = handle.adapter.entry_points[0]
    module, method = handle.adapter.entry(handle.pipe, entry)
    kwargs = handle.adapter.example_inputs(handle.pipe, handle.variant, entry, **shape)
    # forward through __call__: module hooks (FSDP2's all-gather) must run as in training
    fn = module if method == "forward" else getattr(module, method)
    return calibrate_module(handle.modules, lambda: fn(**kwargs))


def flow_matching_loss(model: nn.Module, inputs: dict[str, Any], *,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Rectified-flow loss on the latents in ``inputs["hidden_states"]`` (x0): draw noise
    and t ~ U(0, 1), feed x_t = (1 - t) x0 + t noise, regress the velocity noise - x0 (MSE,
    fp32). The timestep keeps the example's convention: integer or > 1 = t x 1000 (Wan),
    else t (Flux, which scales by 1000 inside)."""
    x0 = inputs["hidden_states"]
    b = x0.shape[0]
    g = generator or torch.Generator(device=x0.device).manual_seed(0)
    # drawn where the generator lives (a CUDA generator: no host-side draw and copy per step)
    noise = torch.randn(x0.shape, generator=g, device=g.device).to(x0)
    t = torch.rand(b, generator=g, device=g.device).to(x0.device)
    tb = t.view(b, *([1] * (x0.dim() - 1))).to(x0.dtype)
    xt = (1 - tb) * x0 + tb * noise
    ts = inputs["timestep"]
    scale = 1000.0 if (not ts.is_floating_point() or float(ts.max()) > 1) else 1.0
    timestep = (t * scale).view(b, *([1] * (ts.dim() - 1))).expand(ts.shape).to(ts.dtype)
    out = model(**{**inputs, "hidden_states": xt, "timestep": timestep})
    pred = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
    return torch.nn.functional.mse_loss(pred.float(), (noise - x0).float())


def shard(model: nn.Module, block_types: Iterable[type] | None = None, *, mesh=None,
          mixed_precision: bool | None = None, reshard_after_forward: bool = True,
          master_dtype: torch.dtype | None = None, cpu_offload: bool = False) -> nn.Module:
    """FSDP2 over a model whose plan is applied: `fully_shard` each repeated block, then the
    root (torchtitan's order: recompute -> compile -> shard; the blocks' compiled forwards
    stay, FSDP's all-gather / reduce-scatter hooks run around them, never traced into them).

    block_types: the classes to shard one by one (default: the classes that carry a
    recompute wrapper or a compiled forward). mixed_precision (default: on CUDA, and
    wherever fp32 masters were made from a bf16 model): bf16 parameters for compute, fp32
    gradient reduction (`MixedPrecisionPolicy`). Needs an
    initialised process group (torchrun); mesh default: all ranks, on the model's device.

    master_dtype: the dtype the trainable parameters are kept (and sharded) in. FSDP2 needs
    one dtype per sharded group, and diffusers keeps some layers of a bf16 model in fp32
    (Wan's norms, modulation table and time embedder). Default: leave a model that already
    has one dtype as it is; otherwise fp32 master weights for all (bf16 compute through the
    mixed-precision policy: the usual mixed-precision training). `torch.bfloat16` halves
    the weight and optimizer-state memory instead, at the cost of those fp32 layers.

    cpu_offload: FSDP2's `CPUOffloadPolicy` -- the sharded parameters, their gradients and
    so the optimizer states live in host memory (pinned on CUDA); each block's parameters
    are copied in for its all-gather and its gradient copied out after the reduce-scatter,
    and the optimizer step runs on the CPU. The card then holds activations and the blocks
    in flight only: the way to fit Wan2.1-14B with AdamW on two 80 GB cards, where AdamW's two
    states alone are 2 x 14 G x 2 bytes / 2 ranks = 26 GiB per card in bf16 (52 in fp32),
    beside the weights and gradients. Calibrate `auto` again after sharding: it counts the
    weights, gradients and states only where they live.
    """
    # lazy: importing FSDP costs ~0.5 s, which every `import magi_zoo` would pay for shard() alone
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("shard needs torch.distributed initialised: launch with torchrun and call "
                           "torch.distributed.init_process_group first")
    device = next(model.parameters()).device
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = _blocks(model, block_types)
    if not blocks:
        raise ValueError("shard: no blocks to shard one by one; pass block_types= (the repeated block classes)")
    found = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    master = unify_dtypes(model, master_dtype)
    upcast = master is not None and any(d != master for d in found)
    if mixed_precision is None:
        # Masters upcast from a bf16 model must compute in bf16 again (its inputs are bf16),
        # on any device; otherwise mixed precision is the CUDA default.
        mixed_precision = device.type == "cuda" or upcast
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    for m in blocks:
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    return model


def unify_dtypes(model: nn.Module, dtype: torch.dtype | None = None) -> torch.dtype | None:
    """Cast the trainable floating-point parameters of `model` to one dtype (`dtype`, or
    float32 when they are mixed and none is given); returns the dtype they end up in."""
    trainable = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    found = {p.dtype for p in trainable}
    if dtype is None:
        if len(found) <= 1:
            return next(iter(found), None)
        dtype = torch.float32
    with torch.no_grad():
        for p in trainable:
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return dtype


def _blocks(model: nn.Module, block_types: Iterable[type] | None) -> list[nn.Module]:
    if block_types is not None:
        types = tuple(block_types)
        return [m for m in model.modules() if isinstance(m, types) and m is not model]
    return [m for m in model.modules() if m is not model and (recompute_state(m) is not None or compiled_methods(m))]

