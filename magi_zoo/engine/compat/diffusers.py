"""diffusers-private names magi_zoo uses, each with why no public API does the job and the
versions checked (diffusers 0.42.1). diffusers is imported lazily: `import magi_zoo` stays
cheap and never imports it."""

from __future__ import annotations
