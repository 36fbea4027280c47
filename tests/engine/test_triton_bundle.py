"""Our own Triton kernels' compiled files travel in the compile cache (`kernels.triton_bundle`):
what is collected (our kernels' groups and compiled C modules, nothing else), how a group
index is rewritten for the directory it is restored into, that existing files are left and
bad names refused, the cache entry's round trip, and (GPU) a warm process whose Triton cache
is empty running our kernels without one Triton compile."""

from __future__ import annotations

import json
import textwrap
from types import SimpleNamespace

import pytest
import torch

from magi_zoo.engine.compile.cache import CompileCache
from magi_zoo.engine.kernels import triton_bundle

from helpers.processes import run_script

FIELDS = {"model": "test/bundle", "dtype": "bfloat16"}


def _group(root, name, files):
    """A Triton cache group as Triton writes it: the files, and an index of absolute paths."""
    d = root / name
    d.mkdir(parents=True)
    for f, data in files.items():
        (d / f).write_bytes(data)
    index = {"child_paths": {f: str(d / f) for f in files}}
    (d / f"__grp__{next(iter(files))}").write_text(json.dumps(index))
    return d


@pytest.fixture
def triton_dirs(tmp_path, monkeypatch):
    """Two Triton cache directories (the saving and the loading process's); in the first, one
    of our kernels (group 'k1', its launcher in 'l1'), Triton's driver helpers ('u1'), another
    project's launcher ('l2') and inductor's kernel ('other'). `use(root)` switches between them."""
    saving, loading = tmp_path / "saving", tmp_path / "loading"
    _group(saving, "k1", {"kern.json": b'{"name": "kern"}', "kern.cubin": b"\x7fELF cubin"})
    _group(saving, "other", {"inductor_kernel.json": b"{}", "inductor_kernel.cubin": b"not ours"})
    c_modules = {}
    for group, name in (("l1", "__triton_launcher.so"), ("u1", "cuda_utils.so"), ("l2", "__triton_launcher.so")):
        (saving / group).mkdir()
        (saving / group / name).write_bytes(b"\x7fELF " + group.encode())
        # a C extension's function: its __self__ is the module, which names its file
        c_modules[group] = SimpleNamespace(__self__=SimpleNamespace(__file__=str(saving / group / name)))
    (saving / "l1" / ".__triton_launcher.so.tmp.pid_1_x").write_bytes(b"half written")
    kernel = SimpleNamespace(metadata_group={"kern.json": str(saving / "k1" / "kern.json"),
                                             "kern.cubin": str(saving / "k1" / "kern.cubin")},
                             _run=SimpleNamespace(launch=c_modules["l1"]))
    fn = SimpleNamespace(device_caches={0: ({"spec": kernel}, {}, None, None, None)})
    monkeypatch.setattr(triton_bundle, "_JIT_FUNCTIONS", [fn])
    monkeypatch.setattr(triton_bundle, "_driver_utils", lambda: SimpleNamespace(load_binary=c_modules["u1"]))
    current = {"root": saving}
    monkeypatch.setattr(triton_bundle, "_cache_root", lambda import_triton=False: current["root"])
    return SimpleNamespace(saving=saving, loading=loading, use=lambda root: current.update(root=root))


def test_collect_takes_our_kernels_and_c_modules_only(triton_dirs):
    files = triton_bundle.collect()
    # our kernel's group (files + index), its launcher and the driver helpers; not inductor's
    # group ('other': torch's own artifacts carry it), not another kernel's launcher, not a
    # temporary file
    assert sorted(files) == ["k1/__grp__kern.json", "k1/kern.cubin", "k1/kern.json", "l1/__triton_launcher.so",
                             "u1/cuda_utils.so"]
    assert json.loads(files["k1/__grp__kern.json"]) == {"child_paths": {"kern.json": "kern.json",
                                                                        "kern.cubin": "kern.cubin"}}


def test_restore_writes_missing_files_and_points_the_index_at_them(triton_dirs):
    files = triton_bundle.collect()
    triton_dirs.use(triton_dirs.loading)
    assert triton_bundle.restore(files) == 5
    d = triton_dirs.loading / "k1"
    assert (d / "kern.cubin").read_bytes() == b"\x7fELF cubin"
    index = json.loads((d / "__grp__kern.json").read_text())
    assert index["child_paths"] == {"kern.json": str(d / "kern.json"), "kern.cubin": str(d / "kern.cubin")}
    # exactly the carried files: no temporary file left behind
    assert sorted(str(p.relative_to(triton_dirs.loading)) for p in triton_dirs.loading.rglob("*")
                  if p.is_file()) == sorted(files)
    # a file Triton already has is left alone; the others are written again only if missing
    (d / "kern.cubin").write_bytes(b"triton's own")
    (d / "kern.json").unlink()
    assert triton_bundle.restore(files) == 1
    assert (d / "kern.cubin").read_bytes() == b"triton's own"


@pytest.mark.parametrize("rel", ["../x", "k1/../../x", "/etc/x", "k1/", "nogroup"])
def test_restore_refuses_names_outside_the_cache(triton_dirs, rel):
    triton_dirs.use(triton_dirs.loading)
    with pytest.raises(ValueError, match="not a Triton cache file name"):
        triton_bundle.restore({rel: b"x"})


def test_nothing_collected_without_triton(monkeypatch):
    monkeypatch.setattr(triton_bundle, "_cache_root", lambda import_triton=False: None)
    assert triton_bundle.collect() == {}


def test_cache_entry_carries_the_files(triton_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"torch artifacts", None))
    saved = CompileCache(tmp_path / "zoo", FIELDS)
    assert saved.save() and saved.kernel_files == 5
    loaded_payloads = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda p: loaded_payloads.append(p) or object())
    triton_dirs.use(triton_dirs.loading)
    warm = CompileCache(tmp_path / "zoo", FIELDS)
    assert warm.load() and warm.status == "hit"
    # torch gets its own bytes only; our files land in the loading process's Triton cache
    assert loaded_payloads == [b"torch artifacts"] and warm.kernel_files == 5
    assert (triton_dirs.loading / "l1" / "__triton_launcher.so").read_bytes() == b"\x7fELF l1"


def test_a_failed_restore_keeps_the_hit(triton_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"torch artifacts", None))
    assert CompileCache(tmp_path / "zoo", FIELDS).save()
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda p: object())

    def unwritable(files):
        raise PermissionError("read-only Triton cache")

    monkeypatch.setattr(triton_bundle, "restore", unwritable)
    warm = CompileCache(tmp_path / "zoo", FIELDS)
    with pytest.warns(RuntimeWarning, match="Triton compiles them on first use"):
        assert warm.load() is True
    assert warm.status == "hit" and warm.kernel_files == 0


_GPU_SCRIPT = textwrap.dedent("""
    import json, sys, torch, triton
    from magi_zoo.engine.compile.cache import CompileCache
    from magi_zoo.engine.kernels import norm_rope
    cache = CompileCache(sys.argv[1], {"model": "test/bundle-gpu"})
    cache.load()
    before = {p.name for p in __import__("pathlib").Path(triton.knobs.cache.dir).rglob("*.so")}
    hits = []
    triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    x = torch.randn(1, 64, 4 * 32, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4 * 32, device="cuda", dtype=torch.bfloat16)
    ang = torch.rand(1, 64, 1, 16, device="cuda")
    cos, sin = torch.cos(ang).repeat_interleave(2, -1), torch.sin(ang).repeat_interleave(2, -1)
    norm_rope.rms_norm_rope(x, w, 1e-6, cos, sin, 4)
    torch.cuda.synchronize()
    after = {p.name for p in __import__("pathlib").Path(triton.knobs.cache.dir).rglob("*.so")}
    triton.knobs.compilation.listener = None  # what follows is inductor's, not ours
    torch.compile(lambda a: a * 2 + 1)(x)  # torch's own artifacts: an entry needs them
    if cache.status == "miss":
        assert cache.save()
    print(json.dumps({"status": cache.status, "hits": hits, "kernel_files": cache.kernel_files,
                      "new_c_modules": sorted(after - before)}))
""")


@pytest.mark.gpu
def test_warm_process_runs_our_kernel_without_compiling(tmp_path):
    def run(tag):
        out = run_script(_GPU_SCRIPT, str(tmp_path / "zoo"), TRITON_CACHE_DIR=str(tmp_path / f"triton-{tag}"))
        return json.loads(out.strip().splitlines()[-1])

    cold = run("cold")
    # cold: Triton compiled the kernel (a miss) and built C modules; the entry carries them
    assert cold["status"] == "saved" and cold["hits"] == [False] and cold["new_c_modules"]
    assert cold["kernel_files"] > len(cold["new_c_modules"])
    warm = run("warm")  # a fresh, empty Triton cache directory
    assert warm["status"] == "hit" and warm["kernel_files"] == cold["kernel_files"]
    # the kernel came from the restored files, and no C compiler ran
    assert warm["hits"] == [True] and warm["new_c_modules"] == []
