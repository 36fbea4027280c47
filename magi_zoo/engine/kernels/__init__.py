"""Attention kernels beyond diffusers' own registry, one module each, imported lazily by the
attention step only when a plan names them (`import magi_zoo` never loads a kernel)."""
