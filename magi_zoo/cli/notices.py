"""Library notices of a normal `magi-zoo run`: captured, counted, kept for `--debug`.

A newcomer's run of a tiny model printed transformers' generation-flag warning, a
`repetition_penalty` UserWarning from its `generate`, and diffusers' echo of every token a
long prompt lost (~200 KB for a 100k-character prompt). None of it is something the user
can act on, and it looks like failure. While `capture()` is active:

- Python warnings raised outside magi_zoo are recorded, not shown (magi_zoo's own warnings,
  e.g. a compile cache that could not be saved, are shown as usual: they say what to do);
- records of WARNING and above from the libraries' loggers (transformers, diffusers, torch,
  accelerate, huggingface_hub, PIL) are recorded, not shown; lower levels pass as usual.

`Captured.summary()` is the one line a run prints about them (how many, from where) and
`Captured.lines()` each in full, for `--debug` (which does not capture at all: everything
prints as it happens). A prompt a text encoder truncated is the one notice the user can act
on: `Captured.truncations()` turns diffusers' echo into one line naming the encoder and its
token limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import warnings
from pathlib import Path
from typing import Iterator

# The library root loggers whose handlers the capture filters (their children propagate to them).
LIBRARIES = ("transformers", "diffusers", "torch", "accelerate", "huggingface_hub", "PIL")
_OURS = str(Path(__file__).resolve().parents[1])  # magi_zoo/: warnings raised here are shown
# diffusers' text-encoder truncation notice (CLIP and T5 alike): "The following part of your input
# was truncated because CLIP can only handle sequences up to 77 tokens: [...]"
_TRUNCATED = re.compile(r"truncated because (?:`?max_sequence_length`? is set to|(\S+) can only handle sequences "
                        r"up to) (\d+)")


@dataclasses.dataclass
class Notice:
    source: str  # the logger's name, or the warning's category
    text: str


@dataclasses.dataclass
class Captured:
    notices: list[Notice] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        """Every captured notice, `source: text`, in order."""
        return [f"{n.source}: {n.text}" for n in self.notices]

    def truncations(self) -> dict[str, int]:
        """encoder -> token limit, for each truncated-prompt notice (the encoder's name as the
        library wrote it, e.g. CLIP; "max_sequence_length" for the pipeline's own limit)."""
        out: dict[str, int] = {}
        for n in self.notices:
            m = _TRUNCATED.search(n.text)
            if m:
                out[m.group(1) or "max_sequence_length"] = int(m.group(2))
        return out

    def summary(self) -> str | None:
        """One line: how many notices were kept out of the output, by source; None if none."""
        if not self.notices:
            return None
        by: dict[str, int] = {}
        for n in self.notices:
            root = n.source.split(".")[0]
            by[root] = by.get(root, 0) + 1
        parts = ", ".join(f"{k} {v}" for k, v in by.items())
        return (f"library notices: {len(self.notices)} kept out of this output ({parts}); "
                "magi-zoo run ... --debug prints them")


class _Filter(logging.Filter):
    def __init__(self, into: Captured):
        super().__init__()
        self.into = into
        self._seen: dict[int, logging.LogRecord] = {}  # a record reaches every handler up the tree: count it once

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        if self._seen.get(id(record)) is record:
            return False
        self._seen[id(record)] = record
        try:
            text = record.getMessage()
        except Exception:  # a library's malformed format arguments: keep what it passed
            text = str(record.msg)
        self.into.notices.append(Notice(record.name, " ".join(text.split())))
        return False


def _library_handlers() -> list[logging.Handler]:
    """Every handler on the library loggers (and their children) and on the root logger, and
    logging's last resort (what a record reaches when no handler is set)."""
    import diffusers.utils.logging  # noqa: F401  # lazy: their root handlers are set up on import,
    import transformers.utils.logging  # noqa: F401  # lazy: and must exist before they are filtered

    found: list[logging.Handler] = list(logging.getLogger().handlers)
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name.split(".")[0] in LIBRARIES:
            found += logger.handlers
    if logging.lastResort is not None:
        found.append(logging.lastResort)
    return list(dict.fromkeys(found))


@contextlib.contextmanager
def capture() -> Iterator[Captured]:
    """Record library warnings and WARNING+ log records instead of printing them (module
    docstring); yields the `Captured` that collects them."""
    into = Captured()
    filt = _Filter(into)
    handlers = _library_handlers()
    for h in handlers:
        h.addFilter(filt)
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if str(Path(filename).resolve()).startswith(_OURS):
                return shown(message, category, filename, lineno, file, line)
            text = " ".join(str(message).split())
            into.notices.append(Notice(category.__name__, f"{text} ({Path(filename).name}:{lineno})"))

        warnings.showwarning = show
        try:
            yield into
        finally:
            for h in handlers:
                h.removeFilter(filt)
