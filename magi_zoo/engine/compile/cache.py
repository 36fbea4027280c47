"""The compile cache (warm start): compile artifacts kept across processes.

A cache over `torch.compiler.save_cache_artifacts` / `load_cache_artifacts` (inductor FX
graphs, AOTAutograd entries, Triton kernels, PGO), plus the compiled files of our own
Triton kernels, which torch's artifacts do not hold (`kernels.triton_bundle`: they run
inside opaque custom ops, built by Triton's JIT).

Entries are keyed by everything that specialises generated code: the resolved plan's spec
digests, the model (adapter + variant), dtype, and `environment_fields()` (torch / triton /
Python / diffusers / transformers versions, the device name). One file per key, written to
a temporary name and renamed into place, so concurrent writers never leave a torn file
(the last complete writer wins) and readers never see a partial one. A file that fails its
checksum, does not parse, or belongs to another key is ignored with a warning and rebuilt
-- never a crash; it is removed only if it is still the file that was read (see
`CompileCache._discard`), so a reader never deletes a fresh entry another process just
wrote. Neither `load` nor `save` raises for a cache problem: they warn, and the caller's
result is never lost to the cache.

File format: MAGIC, a 4-byte big-endian header length, a JSON header
({"format", "key", "fields", "sha256", "size", "parts"}), then the payload: torch's artifact
bytes followed by our kernels' files as JSON ({"<group>/<file>": base64}); `parts` gives the
two lengths, `size` and `sha256` cover both.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import struct
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ...io import fsync_dir
from ..kernels import triton_bundle

ENV_VAR = "MAGI_ZOO_CACHE_DIR"
FORMAT = 2  # 2: our kernels' Triton files after torch's artifacts
MAGIC = b"MAGI_ZOO_COMPILE_CACHE\n"


def _dist_version(name: str) -> str | None:
    """An installed distribution's version, read from its metadata (no import: asking for
    diffusers' version must not import diffusers)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_fields(device: torch.device | str | None = None) -> dict[str, Any]:
    """The machine-side fingerprint: library versions, Python, the device.

    One definition for two readers: the compile cache puts all of it in its key (each field
    can change the generated code: torch / triton / Python versions, the device it was
    tuned for; diffusers / transformers change the traced model code), and every benchmark
    record carries it. `device` picks what `device_name` describes; default: CUDA if
    available, else the CPU.
    """
    try:
        import triton  # lazy: optional (CPU-only installs have no triton) and costly to import

        triton_version = triton.__version__
    except Exception:  # no triton on CPU-only installs
        triton_version = None
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        device_name = torch.cuda.get_device_name(dev)
    else:  # inductor's C++ code is built for the architecture and parallelised for the thread count
        device_name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "diffusers": _dist_version("diffusers"), "transformers": _dist_version("transformers"),
            "device_name": device_name, "cuda": torch.version.cuda}


def resolve_cache_dir(cache_dir: str | os.PathLike | None) -> Path | None:
    """An explicit `cache_dir`, else $MAGI_ZOO_CACHE_DIR, else None (cache off)."""
    value = cache_dir if cache_dir is not None else os.environ.get(ENV_VAR)
    return Path(value).expanduser() if value else None


@dataclasses.dataclass
class CompileCache:
    """One cache entry: load it before compiling, save it after."""

    directory: Path
    fields: dict[str, Any]  # the model-side key fields; environment fields are added
    status: str = "unused"  # unused | miss | hit | rebuilt (corrupt or incompatible) | saved
    saved_frames: int = 0  # frames compiled when last saved (save again only after more)
    load_s: float = 0.0  # wall time spent reading + hot-loading (part of a warm first call)
    kernel_files: int = 0  # our kernels' Triton files: restored by the last load / carried by the last save

    def __post_init__(self):
        self.directory = Path(self.directory)
        self.fields = {**self.fields, **environment_fields()}

    @property
    def key(self) -> str:
        blob = json.dumps({"format": FORMAT, **self.fields}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def path(self) -> Path:
        return self.directory / f"{self.key[:32]}.bin"

    # -- read -------------------------------------------------------------------------------
    def _read_file(self) -> tuple[bytes, tuple[int, int]]:
        """The entry's bytes and the (device, inode) of the file they came from: a later
        `_discard` removes that file only, never one another process renamed into place since."""
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            return f.read(), (st.st_dev, st.st_ino)

    def _parse(self, raw: bytes) -> tuple[bytes, dict[str, bytes]]:
        if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 4:
            raise ValueError("not a magi_zoo compile-cache file")
        (n,) = struct.unpack(">I", raw[len(MAGIC):len(MAGIC) + 4])
        start = len(MAGIC) + 4
        try:
            header = json.loads(raw[start:start + n])
        except ValueError:
            raise ValueError("unreadable header (truncated or corrupt file)") from None
        if not isinstance(header, dict):
            raise ValueError("unreadable header (truncated or corrupt file)")
        payload = raw[start + n:]
        if header.get("format") != FORMAT or header.get("key") != self.key:
            raise LookupError(f"entry was written for another configuration "
                              f"(format {header.get('format')}, fields {header.get('fields')})")
        if len(payload) != header.get("size") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise ValueError("checksum mismatch (truncated or corrupt file)")
        parts = header.get("parts") or {}
        n_torch = parts.get("torch")
        if not isinstance(n_torch, int) or not 0 <= n_torch <= len(payload):
            raise ValueError("unreadable header (no part lengths)")
        kernels = json.loads(payload[n_torch:] or b"{}")
        return payload[:n_torch], {rel: base64.b64decode(data) for rel, data in kernels.items()}

    def _read(self) -> tuple[bytes, dict[str, bytes]]:
        """The verified payload of the entry -- torch's artifacts and our kernels' files
        (raises if absent, corrupt or another key's)."""
        return self._parse(self._read_file()[0])

    def load(self) -> bool:
        """Hot-load the entry into torch's caches. False (and a warning) if absent or bad;
        never raises for a cache problem: the cache only ever saves time."""
        t0 = time.perf_counter()
        try:
            return self._load()
        except Exception as e:  # e.g. an unreadable directory: run without the warm start
            warnings.warn(f"magi_zoo: could not read the compile cache {self.path} ({type(e).__name__}: {e}); "
                          "compiling from scratch", RuntimeWarning, stacklevel=2)
            self.status = "miss"
            return False
        finally:
            self.load_s = time.perf_counter() - t0

    def _load(self) -> bool:
        try:
            raw, ident = self._read_file()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            self.status = "miss"
            return False
        try:
            payload, kernels = self._parse(raw)
            info = torch.compiler.load_cache_artifacts(payload)
            if info is None:
                raise ValueError("torch could not deserialize the artifacts")
        except Exception as e:  # corrupt, incompatible, or from another torch: rebuild
            kind = "incompatible" if isinstance(e, LookupError) else "corrupt"
            warnings.warn(f"magi_zoo: ignoring {kind} compile-cache entry {self.path} ({e}); "
                          "compiling from scratch and rewriting it", RuntimeWarning, stacklevel=3)
            self.status = "rebuilt"
            self._discard(ident)
            return False
        self.status = "hit"
        try:
            self.kernel_files = triton_bundle.restore(kernels)
        except Exception as e:  # e.g. an unwritable Triton cache: Triton compiles them, as without us
            warnings.warn(f"magi_zoo: could not restore our kernels' compiled files from {self.path} "
                          f"({type(e).__name__}: {e}); Triton compiles them on first use", RuntimeWarning,
                          stacklevel=3)
        return True

    def _discard(self, ident: tuple[int, int]) -> None:
        """Remove the bad file just read -- but only if it is still that file. Between our
        read and this unlink another process may have renamed a fresh, valid entry into
        place; deleting it would lose that process's work. The check (same inode) and the
        unlink run under the directory lock that writers hold around their rename, so no
        rename can fall between them. Without `fcntl` (Windows) the file is left: the next
        save replaces it anyway."""
        try:
            with _dir_lock(self.directory) as locked:
                if not locked:
                    return
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == ident:
                    os.unlink(self.path)
        except OSError:
            pass

    # -- write ------------------------------------------------------------------------------
    def save(self, frames_compiled: int | None = None) -> bool:
        """Serialize this process's compile artifacts and atomically replace the entry.

        Never raises for a cache problem (an unwritable or vanished directory, a full disk,
        torch failing to serialize): it warns and returns False, because a failed cache
        write must never cost the result the caller just computed."""
        try:
            return self._save(frames_compiled)
        except Exception as e:
            warnings.warn(f"magi_zoo: could not save the compile cache to {self.directory} "
                          f"({type(e).__name__}: {e}); the result is unaffected", RuntimeWarning, stacklevel=2)
            return False

    def _save(self, frames_compiled: int | None) -> bool:
        result = torch.compiler.save_cache_artifacts()
        if result is None:
            return False
        kernels = triton_bundle.collect()
        kernel_blob = json.dumps({rel: base64.b64encode(data).decode() for rel, data in kernels.items()},
                                 sort_keys=True).encode()
        payload = result[0] + kernel_blob
        header = json.dumps({"format": FORMAT, "key": self.key, "fields": self.fields,
                             "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload),
                             "parts": {"torch": len(result[0]), "triton": len(kernel_blob)}},
                            sort_keys=True, default=str).encode()
        self.directory.mkdir(parents=True, exist_ok=True)
        # mkstemp: a unique name per writer (O_EXCL), in the entry's directory so the rename
        # below stays on one filesystem and is atomic.
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + struct.pack(">I", len(header)) + header + payload)
                f.flush()
                os.fsync(f.fileno())
            with _dir_lock(self.directory):  # see _discard: a reader's check-then-unlink is atomic to us
                os.replace(tmp, self.path)  # atomic on POSIX: readers see old or new, never half
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(self.directory)  # make the rename durable, not only atomic
        self.status = "saved"
        self.kernel_files = len(kernels)
        if frames_compiled is not None:
            self.saved_frames = frames_compiled
        return True


@contextlib.contextmanager
def _dir_lock(directory: Path):
    """An exclusive `flock` on the cache directory itself (no lock file to leave behind),
    held only around a rename or a check-then-unlink: microseconds. Yields whether the lock
    is held (False where `fcntl` or directory locks are unavailable)."""
    try:
        import fcntl  # lazy: optional -- POSIX only (Windows has none)
    except ImportError:  # Windows
        yield False
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock
