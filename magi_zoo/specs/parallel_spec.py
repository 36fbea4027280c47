"""`ParallelSpec`: how a region (a denoiser transformer) is spread over the processes of a
`torchrun` job (the plan's ``parallel`` section).

Three degrees, multiplied together, give the processes one copy of the model spans:

- ``cfg``: classifier-free guidance's two forwards per step (conditional, unconditional) run
  on two different processes and the results are exchanged (one all-gather of the output
  per step): a 2x split with almost no communication, for pipelines that run CFG;
- ``ulysses_degree``: DeepSpeed-Ulysses sequence parallelism (diffusers'
  `ContextParallelConfig`): each process holds 1/N of the tokens; around every attention
  an all-to-all turns that into all tokens for 1/N of the heads, so N must divide the head
  count; four all-to-alls per attention layer, best over NVLink;
- ``ring_degree``: ring attention (diffusers): each process keeps its 1/N of the queries
  and sees every key/value chunk in turn; no head constraint, more steps, needs a backend
  that returns the softmax log-sum-exp.

The world size must be a multiple of ``(2 if cfg else 1) * ulysses_degree * ring_degree``;
more processes than that hold replicas that compute the same thing. A spec file declares
which regions may be parallelised with an all-default entry (``WanTransformer3DModel =
{ cfg = false }``); `load(..., parallel={...})` and ``magi-zoo run --nproc`` set the degrees
on exactly those.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from .section import SectionSpec, register_section


@register_section
class ParallelSpec(SectionSpec):
    """Multi-process split of a region's forward. Frozen. All defaults = not parallel."""

    section: ClassVar[str] = "parallel"

    ulysses_degree: int = Field(
        1, ge=1, description="Ulysses (all-to-all) sequence-parallel degree; must divide the attention "
        "head count and the token count (see `uneven`).")
    ring_degree: int = Field(
        1, ge=1, description="Ring-attention sequence-parallel degree (diffusers' ring attention; needs an "
        "attention backend that returns the log-sum-exp, e.g. '_native_cudnn' or 'flash').")
    cfg: bool = Field(
        False, description="Run the conditional and unconditional forwards of classifier-free guidance on "
        "two processes and exchange the outputs (one all-gather per step).")
    uneven: bool = Field(
        False, description="Allow token counts that do not divide by the sequence degree (diffusers' "
        "`ulysses_anything` / `ring_anything`: uneven shards); off = such a shape is refused with an error.")

    @model_validator(mode="after")
    def _check(self) -> "ParallelSpec":
        if self.uneven and self.ulysses_degree > 1 and self.ring_degree > 1:
            raise ValueError("uneven=true works with one sequence split only (ulysses_degree or ring_degree "
                             "> 1, not both): diffusers' 'anything' modes exist for each alone")
        if self.uneven and self.sequence_degree == 1:
            raise ValueError("uneven=true needs ulysses_degree > 1 or ring_degree > 1 (it describes how the "
                             "sequence is split)")
        return self

    @property
    def sequence_degree(self) -> int:
        """Processes the token sequence is split over (ulysses x ring)."""
        return self.ulysses_degree * self.ring_degree

    @property
    def cfg_degree(self) -> int:
        return 2 if self.cfg else 1

    @property
    def degree(self) -> int:
        """Processes one copy of the region spans (cfg x ulysses x ring)."""
        return self.cfg_degree * self.sequence_degree

    @property
    def active(self) -> bool:
        return self.degree > 1

    def check_world(self, world_size: int, where: str = "parallel") -> int:
        """The number of replicas (world size / degree); a clear error when the degrees do not
        fit `world_size` processes."""
        parts = f"cfg {self.cfg_degree} x ulysses {self.ulysses_degree} x ring {self.ring_degree}"
        if self.degree > world_size:
            raise ValueError(f"{where}: {parts} = {self.degree} processes, but the job has {world_size}; "
                             f"launch with --nproc {self.degree} (torchrun --nproc-per-node {self.degree}) "
                             "or lower the degrees")
        if world_size % self.degree:
            raise ValueError(f"{where}: {parts} = {self.degree} does not divide the world size {world_size}; "
                             f"use degrees whose product divides {world_size}")
        return world_size // self.degree

    def describe(self) -> str:
        parts = [f"ulysses {self.ulysses_degree}"] if self.ulysses_degree > 1 else []
        parts += [f"ring {self.ring_degree}"] if self.ring_degree > 1 else []
        parts += ["cfg 2"] if self.cfg else []
        return " x ".join(parts) + (" (uneven shards)" if self.uneven else "") if parts else "none"


def default_parallel(world_size: int, runs_cfg: bool, heads: int | None = None) -> dict[str, Any]:
    """The degrees `magi-zoo run --nproc N` picks when none are given.

    CFG first: its two branches are independent, so splitting them costs one all-gather of
    the output per step (near-perfect 2x), where a sequence split pays four all-to-alls per
    attention layer. The rest goes to Ulysses, which moves fewer bytes than ring attention
    and keeps one attention call per layer (ring runs N smaller ones) -- as far as the
    denoiser's attention `heads` allow: Ulysses gives each rank heads / degree whole heads, so
    its degree must divide the head count; what is left of the process count goes to ring.
    E.g. Wan2.1-1.3B (12 heads) on 8 processes without CFG: Ulysses 4 x ring 2; with CFG:
    CFG 2 x Ulysses 4; Wan2.1-14B (40 heads) on 8 without CFG: Ulysses 8.
    """
    if world_size < 1:
        raise ValueError(f"--nproc must be a positive integer, got {world_size}")
    if world_size == 1:
        return {}
    out: dict[str, Any] = {}
    rest = world_size
    if runs_cfg and world_size % 2 == 0:
        out["cfg"], rest = True, world_size // 2
    if rest == 1:
        return out
    ulysses = rest if heads is None else max(d for d in range(1, rest + 1) if rest % d == 0 and heads % d == 0)
    if ulysses > 1:
        out["ulysses_degree"] = ulysses
    if rest // ulysses > 1:
        out["ring_degree"] = rest // ulysses
    return out

