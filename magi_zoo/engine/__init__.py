"""The engine: model-agnostic mechanisms that apply a plan to any `nn.Module` tree.

This module is its public surface: what the zoo, the CLI, training, benchmarks and model
adapters import (adapters import nothing else of the engine but `engine.compat`). Never
imports an adapter. Entry point: `apply` (its steps and their fixed order: `apply.py`);
one package per step (prepare, attention, precision, memory_format, recompute, compile,
step_cache, offload, parallel, cuda_graphs).
"""

from .apply import STEP_ORDER, apply, needs_streaming, preview, remove
from .compile import installed
from .custom_ops import CustomOpInfo, custom_op_info, list_custom_ops, register_custom_op
from .prepare import Preparation
from .observe import counters  # the test oracle, `from magi_zoo.engine import counters`
from .observe.progress import rename_stage as progress_rename
from .observe.progress import stage as progress_stage
from .observe.report import Report
from .observe.table import format_table
from .resolve import PlanError, ResolvedPlan, resolve
from .steps import StepRecord, chain_undo

# -- what model adapters use (adapters import the engine through this surface only) ----------
from .kernels.fa3 import fa3_attention
from .kernels.fa3 import missing_reason as fa3_missing_reason
from .kernels.fa3 import wheel_forward as fa3_wheel_forward
from .kernels.gelu_linear import apply as apply_gelu_linear
from .kernels.joint_attention import (JOINT_NORMS, flux_style_processor, joint_norm_rope_attention,
                                      joint_norm_rope_preparation, joint_rope_table, norms_fusable, real_rope_fusable,
                                      rope_tables_fit)
from .kernels.norm_rope import apply as apply_norm_rope
from .kernels.norm_rope import apply_heads as apply_norm_rope_heads
from .offload import hold as offload_hold
from .offload import streams as offload_streams
from .parallel import cfg_parallel_active
from .precision import GELU_EPILOGUE_MARK, NORM_ACT_PAIRS, Fp8Linear, marked_norm, marked_norms
from .precision import eligible as fp8_eligible
from .prepare import instance_forwards, processor_preparation, swap_processors

__all__ = ["apply", "remove", "preview", "needs_streaming", "STEP_ORDER", "installed", "register_custom_op", "custom_op_info",
           "list_custom_ops", "CustomOpInfo", "Preparation", "Report", "StepRecord", "format_table", "counters",
           "PlanError", "ResolvedPlan", "resolve",
           # adapters' names
           "fa3_attention", "fa3_missing_reason", "fa3_wheel_forward", "apply_gelu_linear", "apply_norm_rope",
           "apply_norm_rope_heads", "joint_norm_rope_attention", "joint_rope_table", "rope_tables_fit", "Fp8Linear",
           "JOINT_NORMS", "flux_style_processor", "real_rope_fusable", "joint_norm_rope_preparation", "norms_fusable",
           "fp8_eligible", "offload_hold", "offload_streams", "cfg_parallel_active", "GELU_EPILOGUE_MARK", "NORM_ACT_PAIRS", "chain_undo",
           "marked_norm", "marked_norms", "instance_forwards", "processor_preparation", "swap_processors",
           "progress_stage", "progress_rename"]
