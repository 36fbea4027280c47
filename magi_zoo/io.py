"""Atomic file writes: a reader (or a crash) never sees half a file.

`atomic_write(path, writer)` lets `writer` write a temporary file in the target's own
directory (same filesystem, so the final rename cannot turn into a copy), flushes it to
disk and renames it over `path` with `os.replace`, which POSIX makes atomic: `path` is
either the old complete file or the new complete file. If `writer` raises, the temporary
file is removed and `path` is untouched.

The temporary name keeps the target's suffix (``out.mp4`` -> ``.out.<random>.partial.mp4``)
because writers such as `diffusers.utils.export_to_video`, PIL's `Image.save` and
imageio choose the format from the extension.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename inside it) to disk. Best effort: some
    platforms and filesystems cannot open or fsync a directory, and a rename that is not
    yet durable is still atomic for every reader."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    # The writer closed its own handle; reopen to push its bytes to disk before the rename,
    # so a crash after the rename cannot leave a complete name over incomplete data.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    # os.umask can only be read by setting it; set it back at once.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, writer: Callable[[Path], Any]) -> Path:
    """Write `path` atomically: `writer(tmp)` writes the whole file at `tmp` (a path in the
    same directory with the same suffix), then `tmp` replaces `path`. Returns `path`.

    The parent directory is created if missing. The new file gets the mode the old one had,
    or else the usual mode of a new file (0o666 less the umask) -- not `mkstemp`'s 0o600.
    On any error the temporary file is removed and the error propagates.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".partial{path.suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        writer(tmp)
        if not tmp.is_file():
            raise RuntimeError(f"the writer for {path} did not write its temporary file {tmp}")
        _fsync_file(tmp)
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """`Path.write_bytes`, atomically."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """`Path.write_text`, atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding=encoding))
