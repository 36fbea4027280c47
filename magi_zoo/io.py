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

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "check_writable", "fsync_dir"]


def _nearest_existing(path: Path) -> Path:
    """`path` itself or its closest ancestor that exists (what a `mkdir -p` would write into)."""
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(".")


def _writable_dir(path: Path, directory: Path, what: str) -> None:
    """`directory` (the nearest existing ancestor of where `path` goes) takes new entries."""
    if not directory.is_dir():
        raise ValueError(f"{what} {str(path)!r}: cannot create it, {str(directory)!r} is a file, not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {str(path)!r}: the directory {str(directory)!r} is not writable; choose a "
                         "writable location (or fix its permissions)")


def check_writable(path: str | os.PathLike, *, what: str = "the output", overwrite: bool = False,
                   directory: bool = False, overwrite_hint: str = "pass overwrite=True") -> Path:
    """Refuse now -- before any heavy work -- a path that a later write would fail on or that
    would replace something the user made. `what` names the path in the message (e.g. '--out').

    A file (directory=False): not an existing directory or non-regular file (a device, a
    pipe: an atomic rename would replace the node itself), not an existing file unless
    `overwrite`, and its directory (or the nearest existing ancestor, which the write
    creates the rest under) writable. A directory (directory=True): not an existing file,
    writable, and empty unless `overwrite` (files of the same names are then replaced).
    Returns the path."""
    path = Path(path)
    if directory:
        if path.exists():
            if not path.is_dir():
                raise ValueError(f"{what} {str(path)!r} exists and is not a directory; pass a directory "
                                 "(it is created if missing)")
            if not overwrite and any(path.iterdir()):
                raise ValueError(f"{what} {str(path)!r} is a directory that is not empty; {overwrite_hint} to "
                                 "write into it (files of the same names are replaced), or name a new directory")
        _writable_dir(path, _nearest_existing(path), what)
        return path
    if path.is_dir():
        raise ValueError(f"{what} {str(path)!r} is an existing directory; name a file "
                         f"(e.g. {str(path / ('out' + (path.suffix or '')))!r})")
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise ValueError(f"{what} {str(path)!r} exists and is not a regular file; name a file")
        if not overwrite:
            raise ValueError(f"{what} {str(path)!r} already exists; {overwrite_hint} to replace it, or name "
                             "another file")
    _writable_dir(path, _nearest_existing(path.parent), what)
    return path


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
    if path.is_dir():  # os.replace would fail only after the whole write, naming the temporary file
        raise IsADirectoryError(errno.EISDIR, "is a directory; name a file to write", str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".partial{path.suffix}", dir=path.parent)
    except OSError as e:  # mkstemp's error names its random temporary name, not the user's path
        raise type(e)(e.errno, f"cannot write here ({e.strerror})", str(path)) from e
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
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise type(e)(e.errno, f"cannot replace it ({e.strerror})", str(path)) from e
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
