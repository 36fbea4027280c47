"""The engine: model-agnostic mechanisms that apply a plan to any `nn.Module` tree.

Never imports an adapter. Entry point: `apply` (fixed order, documented there).
"""

from .apply import apply
from .compile import installed, remove
from .custom_ops import CustomOpInfo, custom_op_info, list_custom_ops, register_custom_op
from .report import Report, format_table
from .resolve import PlanError, ResolvedPlan, resolve

__all__ = ["apply", "remove", "installed", "register_custom_op", "custom_op_info", "list_custom_ops",
           "CustomOpInfo", "Report", "format_table", "PlanError", "ResolvedPlan", "resolve"]
