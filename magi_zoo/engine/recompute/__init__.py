"""The recompute step: activation checkpointing per region, with the policy as data.

Policies (`RecomputeSpec.policy`):

- ``full``: plain checkpoint, everything recomputed;
- ``selective``: `create_selective_checkpoint_contexts` with a policy that keeps the
  outputs of the `save` ops (op groups or names) and of every custom op registered with
  ``is_compute_sensitive=True`` (the reader of that flag), recomputing the rest;
- ``auto``: per block one of {full, keep attention, keep matmuls, keep both, no
  checkpoint}, chosen by `choose` (a pure function) from a measured `BlockProfile` so that
  the step's estimated peak fits `train_peak_gib` at the least recompute time. The profile
  is measured by `calibrate(root, run)` -- one forward of `run` with the first block of
  every auto region run eagerly under an op-recording dispatch mode; `load(train=True)`
  does it on the model's example inputs. Until then an auto block refuses a grad-mode call.

One module per job: `step` (the wrapper and `recompute_step`), `policy` (op groups, save
sets, the selective policy), `auto` (the cost model and solver), `measure` (measuring a
block, by sizes: never an allocator reading that a cap or fragmentation moves; `measure_peak`
for a whole step off CUDA), `calibration` (`calibrate`: measure, account for the step's peak, choose).
docs/training.md tells the design; docs/steps.md the step's place in `apply`.
"""

from .auto import AUTO_SAVES, BlockProfile, Choice, GroupCost, Option, OptionCost, choose, choose_within, options
from .calibration import calibrate, fsdp_in_flight_bytes
from .measure import LiveBytes, measure_block, measure_options, measure_peak
from .policy import (DOWN, context_fn, group_ops, is_compute_sensitive, is_down_projection, op_group, option_name,
                     save_set)
from .step import BlockState, block_choices, recompute_state, recompute_step

__all__ = ["recompute_step", "calibrate", "block_choices", "recompute_state", "BlockState",
           "choose", "choose_within", "options", "Option", "OptionCost", "Choice", "BlockProfile", "GroupCost",
           "AUTO_SAVES", "measure_block", "measure_options", "measure_peak", "LiveBytes", "fsdp_in_flight_bytes",
           "DOWN", "context_fn", "group_ops", "is_compute_sensitive", "is_down_projection", "op_group",
           "option_name", "save_set"]
