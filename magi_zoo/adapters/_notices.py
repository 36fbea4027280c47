"""Quieting library notices users cannot act on (installed when a model is built, so
`import magi_zoo` and `list_models()` never import transformers)."""

from __future__ import annotations

import logging

# Library notices about things the user cannot act on, dropped from transformers' own
# handler (and nothing else): (1) "`XImageProcessor` requires torchvision ...; falling back
# to `XImageProcessorPil`": the PIL processors are what we use (image preprocessing on the
# host; torchvision is not a dependency), and the notice fires on diffusers' imports, not on
# our code; (2) "Unrecognized keys in `rope_parameters` ... {'mrope_section', 'interleaved'}":
# transformers' validator does not know keys of Qwen3-Omni's own published config.
_QUIET = ("requires torchvision (not installed); falling back to", "Unrecognized keys in `rope_parameters`")


def quiet_library_notices() -> None:
    """Drop the notices in `_QUIET` from transformers' own handler (idempotent)."""
    from transformers.utils import logging as hf_logging  # lazy: transformers costs seconds

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not any(q in record.getMessage() for q in _QUIET)

    for handler in hf_logging.get_logger().handlers:  # the library root logger's own handler
        if not any(type(f).__name__ == "_Drop" for f in handler.filters):  # once per handler
            handler.addFilter(_Drop())
