"""The offload plan as text, for `magi-zoo spec`: what stays, what streams, the buffers,
the expected copy time and peak -- or why there is no plan."""

from __future__ import annotations

import torch.nn as nn

from .plan import GIB, POOL_SEP, OffloadPlanError, size
from .planner import phase_activations
from .units import plan_units, planner_settings


def describe_plan(root: nn.Module, resolved_plan, profile, budget_gib: float | None = None) -> str:
    """The offload plan as text (`magi-zoo spec`): budget, what stays, what streams, buffers,
    expected copy time per call and expected peak; or why there is none."""
    try:
        plan, specs, units, settings = plan_units(root, resolved_plan, profile, budget_gib=budget_gib)
    except OffloadPlanError as e:
        return f"[offload plan]\n  refused: {e}"
    if plan is None:
        return "[offload plan]\n  (no offload units in the spec: nothing may stream)"
    lines = ["[offload plan]", f"  {plan.summary(units)}"]
    if plan.streams:
        held = plan.host_held_paths()
        by_group: dict[str, list[str]] = {}
        for u in units:
            by_group.setdefault(u.group, []).append(u.name)
        for g, names in by_group.items():
            res = [n for n in names if n in plan.resident]
            n_str = len(names) - len(res)
            if len(names) > 1 and res and n_str:
                short = ", ".join(n.rsplit(".", 1)[-1] for n in res)
                lines.append(f"  {g}: resident {short}; the other {n_str} stream")
            else:
                lines.append(f"  {g}: {'all ' if len(names) > 1 else ''}{'resident' if res else 'streamed'}"
                             f"{f' ({len(names)})' if len(names) > 1 else ''}")
        for g, (n, b) in plan.slots.items():
            label = f"(one pool shared by {', '.join(g.split(POOL_SEP))})" if POOL_SEP in g else g
            lines.append(f"  buffers {label}: {n} x {b / GIB:.3f} GiB")
        lines.append(f"  prefetch: {plan.prefetch} copy/copies in flight ahead of use (host->device "
                     f"{planner_settings(settings)['bandwidth_bytes_s'] / 1e9:g} GB/s assumed); pinned host memory "
                     f"{size(sum(u.nbytes for u in units if u.name in held))}"
                     f"; activation reserve {size(plan.activation)}"
                     + "".join(f"; {ph} phase {size(b)}" for ph, b in phase_activations(units, 0).items() if b))
        for ph, names in plan.evict.items():
            lines.append(f"  phase residency: while {ph} runs, {len(names)} resident unit(s) leave the card "
                         f"({size(sum(u.nbytes for u in units if u.name in set(names)))}: "
                         f"{', '.join(n.rsplit('.', 2)[-2] + '.' + n.rsplit('.', 1)[-1] if '.' in n else n for n in names[:6])}"
                         f"{' ...' if len(names) > 6 else ''}); copied back before their phase runs again "
                         + ", ".join(f"({p} {s * 1e3:.0f} ms)" for p, s in plan.reload_s.items()))
    return "\n".join(lines)
