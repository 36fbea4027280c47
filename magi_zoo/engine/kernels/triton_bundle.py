"""Our own Triton kernels' compiled files, carried in the compile-artifact cache.

torch's `save_cache_artifacts` bundles the Triton kernels *inductor* generates, but our kernels
(`fp8_quant`, `norm_rope`) run inside opaque custom ops: Triton's JIT builds them on their first
call and keeps the result only in Triton's own cache directory. A warm start on a machine (or a
container) that has the magi_zoo cache but not that directory then pays, per kernel, Triton's
compile plus a C compiler run for its launcher, and once per process a C compiler run for
Triton's CUDA driver helpers: about half a second each, measured as the gap between the bf16
and fp8 warm first calls on Wan-1.3B.

`collect()` reads those files -- the cache groups of every kernel our JIT functions compiled in
this process, of their C launchers and of Triton's driver helpers -- as `{"<group>/<file>": bytes}`. `restore()` writes what is missing back into the
current Triton cache directory, so Triton's JIT finds them there on its first call. A group's
index file (`__grp__*.json`) holds absolute paths; it is stored with file names only and
rewritten for the directory it is restored into. Everything here is keyed by Triton's own
hashes (source, options, platform), so a file from another machine or version is never picked
up by a kernel it does not belong to: it is just unused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ...io import atomic_write_bytes

_JIT_FUNCTIONS: list = []  # every @triton.jit function of ours, appended as it is built


def track(fn):
    """Record one of our `@triton.jit` kernels (returns it, so it can wrap the definition)."""
    _JIT_FUNCTIONS.append(fn)
    return fn


def _cache_root(import_triton: bool = False) -> Path | None:
    """Triton's cache directory in this process ($TRITON_CACHE_DIR or its default); None
    without triton, or -- unless `import_triton` -- where nothing imported it yet (then none
    of our kernels ran, and saying so needs no import)."""
    if "triton" not in sys.modules:
        if not import_triton:
            return None
        try:
            # lazy: triton is optional (CPU builds of torch lack it); asked only when restoring
            import triton  # noqa: F401
        except ImportError:  # a CPU build of torch: no kernel of ours can run here
            return None
    # lazy: triton is optional (CPU builds lack it); imported above or by a kernel already
    from triton import knobs  # every triton torch>=2.11 installs has it

    root = knobs.cache.dir
    return Path(root) if root else None


def _our_kernels():
    """Every kernel (Triton's CompiledKernel) our JIT functions built in this process."""
    for fn in _JIT_FUNCTIONS:
        for caches in getattr(fn, "device_caches", {}).values():
            yield from caches[0].values()  # (kernel_cache, key_cache, target, backend, binder)


def _module_file(function) -> Path | None:
    """The shared library a C extension's function comes from (its module's file)."""
    path = getattr(getattr(function, "__self__", None), "__file__", None)
    return Path(path) if path else None


def _driver_utils():
    """Triton's CUDA driver helpers (a C module it compiles once per cache), if loaded."""
    try:
        from triton.runtime import driver  # lazy: triton is optional; a kernel of ours ran, so it loaded

        return getattr(driver.active, "utils", None)
    except Exception:  # no GPU driver here: none of our kernels ran either
        return None


def _groups() -> set[Path]:
    """The cache directories (groups) to carry: each of our kernels' own (read off its file
    list: Triton names a group by a base32 form of its hash), its C launcher's, and the driver
    helpers' -- not every C module in Triton's directory, which holds every other project's too."""
    groups = set()
    kernels = list(_our_kernels())
    for kernel in kernels:
        groups.update(Path(p).parent for p in (getattr(kernel, "metadata_group", None) or {}).values())
        launcher = _module_file(getattr(getattr(kernel, "_run", None), "launch", None))
        if launcher is not None:
            groups.add(launcher.parent)
    utils = _driver_utils() if kernels else None
    helpers = _module_file(getattr(utils, "load_binary", None))
    if helpers is not None:
        groups.add(helpers.parent)
    return groups


def collect() -> dict[str, bytes]:
    """This process's compiled files of our kernels and of Triton's C modules, by
    `<group>/<file>` under Triton's cache directory. Empty where triton never ran."""
    root = _cache_root()
    if root is None or not root.is_dir():
        return {}
    # a group outside Triton's directory (its setting changed mid-process) is left out: it
    # could not be restored under the same name
    groups = {g for g in _groups() if g.parent.resolve() == root.resolve()}
    files: dict[str, bytes] = {}
    for group in sorted(groups):
        if not group.is_dir():
            continue
        for path in sorted(group.iterdir()):
            if not path.is_file() or path.name.startswith(".") or ".tmp." in path.name or path.name == "lock":
                continue
            data = path.read_bytes()
            if path.name.startswith("__grp__"):  # absolute paths -> file names
                index = json.loads(data)
                index["child_paths"] = {c: Path(p).name for c, p in index.get("child_paths", {}).items()}
                data = json.dumps(index).encode()
            files[f"{group.name}/{path.name}"] = data
    return files


def restore(files: dict[str, bytes]) -> int:
    """Write the files that are missing into Triton's cache directory; the number written.
    Existing files are left alone (Triton wrote them, or an earlier restore did)."""
    if not files:
        return 0
    root = _cache_root(import_triton=True)
    if root is None:
        return 0
    written = 0
    # group indexes last: Triton takes a group as present once its index is, so the files
    # the index names must be in place before it
    for rel, data in sorted(files.items(), key=lambda kv: kv[0].split("/", 1)[-1].startswith("__grp__")):
        group, _, name = rel.partition("/")
        if "/" in name or group in ("", ".", "..") or name in ("", ".", ".."):
            raise ValueError(f"not a Triton cache file name: {rel!r} (expected '<group>/<file>')")
        dest = root / group / name
        if dest.exists():
            continue
        if name.startswith("__grp__"):
            index = json.loads(data)
            index["child_paths"] = {c: str(root / group / b) for c, b in index.get("child_paths", {}).items()}
            data = json.dumps(index).encode()
        atomic_write_bytes(dest, data)  # another process reading the group never sees half a file
        written += 1
    return written
