"""transformers-private names magi_zoo uses, each with why no public API does the job and
the versions checked (transformers 5.17 on the GPU image, the newest on CI). transformers
is imported lazily: `import magi_zoo` stays cheap and never imports it."""

from __future__ import annotations
