"""`RecomputeSpec`: which activations a region keeps for the backward pass and which it
recomputes (the plan's ``recompute`` section).

Policies, per region (a region is usually a repeated block class):

- ``none``: no checkpointing; autograd keeps everything it needs (fastest, most memory);
- ``full``: checkpoint the block; only its inputs are kept, everything is recomputed;
- ``selective``: checkpoint the block but keep the outputs of the ops named in `save`
  (``"matmuls"``, ``"attention"``, or op names such as ``"aten.mm"``), so backward
  recomputes only the cheap ops in between;
- ``auto``: per block one of the above, chosen from a measured profile so that the
  training step's peak fits `train_peak_gib` at the least recompute time (its own name:
  `memory_budget_gib` is the offload plan's device-memory budget).

`selective` and `auto` also keep the outputs of custom ops registered with
``is_compute_sensitive=True``; `full` recomputes everything.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from .plan import PlanLayer
from .section import SectionSpec, build_spec, register_section

POLICIES = ("none", "full", "selective", "auto")
# Op groups `save` may name, as data: the aten ops each stands for (every overload). A
# matmul's output is what its backward's neighbours need and the costliest to recompute;
# attention likewise (its kernels also save the logsumexp the backward reads). Under
# dispatch, `F.linear` / `torch.matmul` arrive as mm / addmm / bmm and SDPA as one of its
# fused kernels (which one depends on the device and the backend chosen).
OP_GROUPS: dict[str, tuple[str, ...]] = {
    "matmuls": ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm", "aten.linear",
                "aten.matmul",
                "magi_zoo.linear_gelu_tanh"),  # a linear with its GELU in the GEMM (engine/kernels/gelu_linear.py)
    "attention": ("aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
                  "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
                  "aten._scaled_dot_product_fused_attention_overrideable", "aten._flash_attention_forward",
                  "aten._efficient_attention_forward", "aten.scaled_dot_product_attention",
                  "magi_zoo.fa3_attention"),  # FA3 forward + cuDNN backward (engine/kernels/fa3.py)
}
# Groups defined by the operands' shapes, read by the selective policy at trace time: a
# matmul whose reduction dim K exceeds its output dim N (an MLP's second linear) costs K / N
# times more compute per byte of output than a square one -- the matmul output most worth
# keeping once attention is kept.
SHAPE_GROUPS: dict[str, str] = {
    "down-projections": "matmuls whose reduction dim exceeds their output dim (K > N: an MLP's second linear)",
}
SAVE_GROUPS = (*OP_GROUPS, *SHAPE_GROUPS)


def resolve_op_name(name: str):
    """The torch op a `save` entry names: ``aten.mm`` / ``aten::mm`` (every overload) or
    ``aten.mm.default`` (one overload); an unknown name raises with a did-you-mean."""
    import torch  # lazy: specs are plain data and import without torch; only naming an op needs it

    text = name.strip().replace("::", ".")
    parts = text.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"save entry {name!r}: write an op group ({', '.join(map(repr, SAVE_GROUPS))}) or an "
                         "op name 'namespace.op' or 'namespace.op.overload', e.g. 'aten.mm'")
    ns, op = parts[0], parts[1]
    try:
        namespace = getattr(torch.ops, ns)
        packet = getattr(namespace, op)
    except (AttributeError, RuntimeError):
        known = _known_names(ns)
        close = difflib.get_close_matches(f"{ns}.{op}", known, n=1, cutoff=0.6)
        hint = f" -- did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"save entry {name!r}: no torch op {ns}.{op}{hint} (groups: "
                         f"{', '.join(map(repr, SAVE_GROUPS))})") from None
    if len(parts) == 2:
        return packet
    try:
        return getattr(packet, parts[2])
    except AttributeError:
        raise ValueError(f"save entry {name!r}: {ns}.{op} has no overload {parts[2]!r}; overloads: "
                         f"{', '.join(packet.overloads())}") from None


def _known_names(ns: str) -> list[str]:
    """Candidate op names for a did-you-mean: the ops torch has loaded in namespace `ns`
    (``dir(torch.ops.aten)`` lists every aten op), or the namespaces' group members."""
    import torch  # lazy: as in `resolve_op_name`

    try:
        return [f"{ns}.{n}" for n in dir(getattr(torch.ops, ns)) if not n.startswith("__")]
    except AttributeError:
        return [n for ops in OP_GROUPS.values() for n in ops]


@register_section
class RecomputeSpec(SectionSpec):
    """What a region keeps for backward and what it recomputes. Frozen.

    A spec file lists the regions that may be checkpointed (the repeated blocks) with
    ``policy = "none"``; `load(..., train=True, recompute=...)` sets exactly those.
    """

    section: ClassVar[str] = "recompute"
    # The training peak had the offload budget's name; the two mean different memories.
    renamed_fields: ClassVar[dict[str, str]] = {"memory_budget_gib": "train_peak_gib"}

    policy: Literal["none", "full", "selective", "auto"] = Field(
        "none", description="'none': keep every activation; 'full': keep the block inputs, recompute "
        "the rest; 'selective': keep the outputs of the `save` ops; 'auto': per block, what fits "
        "`train_peak_gib` at the least recompute time (measured).")
    save: tuple[str, ...] | None = Field(
        None, description="selective only: op groups ('matmuls', 'attention', 'down-projections': "
        "matmuls with K > N) and/or op names "
        "('aten.mm', 'aten._scaled_dot_product_flash_attention'); default both groups.")
    train_peak_gib: float | None = Field(
        None, gt=0, description="auto only (required): the peak device memory a training step may "
        "reach -- weights, gradients, optimizer states and activations together (formerly "
        "memory_budget_gib, the offload budget's name).")
    optimizer_states: float = Field(
        2.0, ge=0, description="auto only: bytes of optimizer state per byte of trainable weight, "
        "counted against the budget (AdamW 2, SGD with momentum 1, none 0).")

    @field_validator("save", mode="before")
    @classmethod
    def _save_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            return (v,)
        return tuple(v) if isinstance(v, list) else v  # a TOML array; the field is strict about the rest

    @field_validator("save")
    @classmethod
    def _save_names(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("save is empty; name what to keep ('matmuls', 'attention', op names) or use "
                             "policy='full' to keep nothing")
        for name in v:
            if name not in SAVE_GROUPS:
                if "." not in name and ":" not in name:
                    close = difflib.get_close_matches(name, SAVE_GROUPS, n=1, cutoff=0.5)
                    hint = f" -- did you mean {close[0]!r}?" if close else ""
                    raise ValueError(f"save entry {name!r} is not an op group{hint}; groups: "
                                     f"{', '.join(map(repr, SAVE_GROUPS))}, or an op name like 'aten.mm'")
                resolve_op_name(name)
        return tuple(dict.fromkeys(v))

    @model_validator(mode="after")
    def _fields_fit_policy(self) -> "RecomputeSpec":
        if self.save is not None and self.policy != "selective":
            raise ValueError(f"save= is for policy='selective' (got policy={self.policy!r}); drop save or "
                             "set policy='selective'")
        if self.policy == "auto" and self.train_peak_gib is None:
            raise ValueError("policy='auto' needs train_peak_gib (the peak a training step may reach, "
                             "e.g. 16)")
        if self.train_peak_gib is not None and self.policy != "auto":
            raise ValueError(f"train_peak_gib is for policy='auto' (got policy={self.policy!r})")
        return self

    @property
    def saved(self) -> tuple[str, ...]:
        """What a selective region keeps (its `save`, default matmuls and attention)."""
        return self.save if self.save is not None else tuple(OP_GROUPS)

    @classmethod
    def from_shorthand(cls, value: Any) -> "RecomputeSpec":
        # `WanTransformerBlock = "full"` is shorthand for { policy = "full" }.
        if isinstance(value, str):
            if value not in POLICIES:
                close = difflib.get_close_matches(value, POLICIES, n=1)
                hint = f" -- did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"recompute policy {value!r}{hint}; choices: {', '.join(POLICIES)}")
            return cls(policy=value)
        return super().from_shorthand(value)


def with_recompute(layers: list, value: Any) -> list:
    """The layers plus a user layer setting `value` (a policy name, a dict of
    `RecomputeSpec` fields, or a spec) on every region the recompute section names in any
    layer -- the blocks a spec file declares may be checkpointed. No such region is an error:
    the model's spec does not say which of its modules are the repeated blocks."""
    if isinstance(value, RecomputeSpec):
        spec = value
    elif isinstance(value, str):
        spec = RecomputeSpec.from_shorthand(value)
    elif isinstance(value, dict):
        spec = build_spec(RecomputeSpec, value, "recompute=")
    else:
        raise TypeError(f"recompute= takes a policy name ({', '.join(POLICIES)}), a dict of RecomputeSpec "
                        f"fields or a RecomputeSpec; got {type(value).__name__}")
    keys = list(dict.fromkeys(key for _, layer in layers for key in layer.entries("recompute")))
    if not keys:
        raise ValueError(f"recompute={spec.policy!r}: this spec declares no [*.recompute] regions; add e.g. "
                         "`Block = \"none\"` under [default.recompute] for the repeated blocks")
    # Every field explicit, so no field of a lower layer folds in under the new policy.
    fields = {k: getattr(spec, k) for k in RecomputeSpec.model_fields}
    top = PlanLayer(recompute={k: fields for k in keys})
    if layers and layers[-1][0] == "user":
        return [*layers[:-1], ("user", top.merged_over(layers[-1][1]))]
    return [*layers, ("user", top)]
