"""The engine: model-agnostic mechanisms that apply a plan to any `nn.Module` tree.

Never imports an adapter. Entry point: `apply` (its steps and their fixed order are
documented there); one module per step: prepare, attention, compile, offload.
"""

from .apply import STEP_ORDER, apply, needs_streaming, preview, remove
from .compile import installed
from .custom_ops import CustomOpInfo, custom_op_info, list_custom_ops, register_custom_op
from .prepare import Preparation
from .observe import counters  # the test oracle, `from magi_zoo.engine import counters`
from .observe.report import Report
from .observe.table import format_table
from .resolve import PlanError, ResolvedPlan, resolve
from .steps import StepRecord

__all__ = ["apply", "remove", "preview", "needs_streaming", "STEP_ORDER", "installed", "register_custom_op", "custom_op_info",
           "list_custom_ops", "CustomOpInfo", "Preparation", "Report", "StepRecord", "format_table", "counters",
           "PlanError", "ResolvedPlan", "resolve"]
