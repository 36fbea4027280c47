"""The attention step: set the attention backend of every attention layer under a region.

Three kinds of attention layer take a backend: diffusers' (a processor dispatching through
`diffusers.models.attention_dispatch`), transformers' (calling the attention interface their
config names) and this project's own (declaring ATTENTION_BACKENDS). `backends` knows the backend
names, which can run here and what `auto` picks; `layers` finds each kind of layer and sets it;
`step` is `attention_step`. docs/attention.md describes the choices.
"""

from .backends import (ALIASES, ENGINE_BACKENDS, TRANSFORMERS_NAMES, auto_backend, check_name,
                       unavailable_reason)
from .layers import engine_layers, processors, transformers_layers
from .step import attention_step

__all__ = ["attention_step", "ENGINE_BACKENDS", "ALIASES", "TRANSFORMERS_NAMES", "auto_backend", "check_name",
           "unavailable_reason", "processors", "engine_layers", "transformers_layers"]
