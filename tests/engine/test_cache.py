"""Warm-start compile cache: hit on a fresh inductor dir, atomic concurrent writes, and
corrupt / incompatible entries ignored with a warning and rebuilt (never a crash)."""

import multiprocessing as mp
import textwrap

import pytest
import torch

from magi_zoo.engine.compile.cache import ENV_VAR, CompileCache, resolve_cache_dir

from helpers.processes import inductor_isa_env, run_script

FIELDS = {"model": "test/toy", "dtype": "float32", "plan": [["", "forward", "abc"]]}


def test_env_var_and_explicit_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_cache_dir(None) is None
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert resolve_cache_dir(None) == tmp_path / "env"
    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"  # explicit wins


def test_key_covers_plan_versions_and_device(tmp_path):
    a = CompileCache(tmp_path, FIELDS)
    b = CompileCache(tmp_path, {**FIELDS, "plan": [["", "forward", "def"]]})
    c = CompileCache(tmp_path, {**FIELDS, "dtype": "bfloat16"})
    assert len({a.key, b.key, c.key}) == 3
    # the machine side of the key: everything that specialises generated code
    assert {"torch", "triton", "python", "diffusers", "transformers", "device_name", "cuda"} <= set(a.fields)
    assert CompileCache(tmp_path, FIELDS).key == a.key  # same fields, same machine: same entry


def test_first_load_into_empty_dir_is_a_miss(tmp_path):
    # No file exists for this key in an empty directory: "miss", nothing hot-loaded.
    c = CompileCache(tmp_path / "empty", FIELDS)
    assert c.status == "unused"  # nothing tried yet
    assert c.load() is False
    assert c.status == "miss"


_WARM_SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch._dynamo.utils import counters
    from magi_zoo.engine.compile.cache import CompileCache
    cache = CompileCache(sys.argv[1], {"model": "test/toy"})
    cache.load()
    f = torch.compile(lambda x: torch.nn.functional.gelu(x @ x.T) + 1)
    f(torch.randn(8, 8))
    if cache.status == "miss":
        assert cache.save()
    print(cache.status, counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
""")


def test_warm_start_hits_in_fresh_process(tmp_path):
    # Each process gets its own empty inductor cache dir, so only our artifact file can
    # carry compiled code from the first process to the second (the vector ISA this process
    # probed is handed over: no compiled graph, and ~5 s less of g++ per process).
    def run(tag):
        return run_script(_WARM_SCRIPT, str(tmp_path / "zoo"), **inductor_isa_env(),
                          TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{tag}")).split()

    assert run("cold") == ["saved", "0", "1"]  # compiled from scratch: 1 FX graph miss, saved
    assert run("warm") == ["hit", "1", "0"]  # loaded: the same graph is a cache hit


def _write_entry(path, payload, idx):
    import torch

    torch.compiler.save_cache_artifacts = lambda: (payload, None)  # this writer's bytes
    CompileCache(path, FIELDS).save()


def test_concurrent_writers_never_corrupt(tmp_path):
    payloads = [bytes([i]) * (3_000_000 + i) for i in range(4)]  # big enough to interleave
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_write_entry, args=(tmp_path, p, i)) for i, p in enumerate(payloads)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    entry = CompileCache(tmp_path, FIELDS)
    assert entry._read()[0] in payloads  # one complete writer's bytes, checksum verified
    assert [f.name for f in tmp_path.iterdir()] == [entry.path.name]  # no temp files left


def _valid_entry(tmp_path, fields=FIELDS, payload=b"x" * 100):
    orig = torch.compiler.save_cache_artifacts
    torch.compiler.save_cache_artifacts = lambda: (payload, None)
    try:
        c = CompileCache(tmp_path, fields)
        c.save()
    finally:
        torch.compiler.save_cache_artifacts = orig
    return c


def test_valid_entry_is_saved_then_hit(tmp_path, monkeypatch):
    c = _valid_entry(tmp_path)
    assert c.status == "saved"  # save() wrote the entry
    # A second handle on the same key finds the file, its checksum holds, and torch accepts
    # the payload (stubbed: these bytes are not real artifacts) -> "hit".
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda payload: object())
    again = CompileCache(tmp_path, FIELDS)
    assert again.load() is True and again.status == "hit"


def test_corrupt_entry_warns_and_is_rebuilt(tmp_path):
    c = CompileCache(tmp_path, FIELDS)
    c.directory.mkdir(exist_ok=True)
    c.path.write_bytes(b"garbage, not a cache file")
    with pytest.warns(RuntimeWarning, match="ignoring corrupt compile-cache entry"):
        assert c.load() is False
    # the file exists but does not start with MAGIC: "rebuilt", and the bad file is removed
    assert c.status == "rebuilt" and not c.path.exists()


def test_truncated_entry_fails_checksum(tmp_path):
    c = _valid_entry(tmp_path)
    c.path.write_bytes(c.path.read_bytes()[:-10])
    again = CompileCache(tmp_path, FIELDS)
    with pytest.warns(RuntimeWarning, match="checksum mismatch"):
        assert again.load() is False
    # header intact, payload 10 bytes short of its recorded size: "rebuilt"
    assert again.status == "rebuilt" and not again.path.exists()


def test_incompatible_entry_warns(tmp_path):
    other = _valid_entry(tmp_path, {**FIELDS, "dtype": "bfloat16"})
    mine = CompileCache(tmp_path, FIELDS)
    other.path.rename(mine.path)  # another configuration's file under this key's name
    with pytest.warns(RuntimeWarning, match="ignoring incompatible compile-cache entry"):
        assert mine.load() is False
    # the header's key is the bfloat16 entry's, not this one's: "rebuilt"
    assert mine.status == "rebuilt" and not mine.path.exists()


def test_undeserializable_payload_warns(tmp_path):
    _valid_entry(tmp_path, payload=b"not torch artifacts")
    c = CompileCache(tmp_path, FIELDS)
    with pytest.warns(RuntimeWarning, match="ignoring corrupt"):
        assert c.load() is False
    # checksum holds, but torch cannot deserialize the bytes: "rebuilt"
    assert c.status == "rebuilt" and not c.path.exists()


# The handle's auto-save, with torch's artifact serializer stubbed. What the real one
# returns depends on the whole process's history (it serializes every artifact recorded
# since start-up, and the eager backend records none), so a real call would make the
# status depend on which tests ran before; the real round trip is
# test_warm_start_hits_in_fresh_process, in fresh processes.
def _load_wan(tmp_path):
    import magi_zoo

    return magi_zoo.load("wan2.1-tiny", gpu="cpu", cache_dir=tmp_path / "zoo",
                         compile={"WanTransformerBlock": {"backend": "eager"}})


def test_load_with_cache_dir_saves_after_first_call(tmp_path, fresh_dynamo, monkeypatch):
    saves = []

    def fake_save():
        saves.append(1)
        return b"artifacts", None

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", fake_save)
    h = _load_wan(tmp_path)
    assert h.cache.status == "miss"  # an empty cache dir has no entry for this key
    call = dict(h.variant.call_defaults, prompt="x", num_inference_steps=1)
    h(output_type="np", **call)
    # 1 step with CFG = 2 transformer calls x 4 WanTransformerBlocks = 8 block calls, all
    # under no_grad with the same shapes -> 1 frame; 1 compiled > 0 saved -> the handle
    # saves once: "saved", at 1 frame.
    assert (h.report().region("WanTransformerBlock").calls, h.report().frames) == (8, 1)
    assert (h.cache.status, h.cache.saved_frames, len(saves)) == ("saved", 1, 1)
    h(output_type="np", **call)
    # same shapes: 0 new frames (still 1 == saved_frames) -> no second save
    assert (h.report().frames, len(saves)) == (1, 1)
    # A second handle (same model, plan, dtype, machine: same key) finds the entry: "hit".
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda payload: object())
    assert _load_wan(tmp_path).cache.status == "hit"


def test_nothing_to_save_stays_miss(tmp_path, fresh_dynamo, monkeypatch):
    # torch had no artifacts to serialize (returns None): no file is written, the status
    # stays "miss", and no frame counts as saved (the next compile tries again).
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    h = _load_wan(tmp_path)
    h(output_type="np", **dict(h.variant.call_defaults, prompt="x", num_inference_steps=1))
    assert (h.report().frames, h.cache.status, h.cache.saved_frames) == (1, "miss", 0)
    assert not h.cache.path.exists()


# -- a failing cache never costs the result ------------------------------------------------
def test_save_when_torch_raises_warns_and_returns_false(tmp_path, monkeypatch):
    def broken():
        raise RuntimeError("artifact serialization failed")

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", broken)
    c = CompileCache(tmp_path, FIELDS)
    with pytest.warns(RuntimeWarning, match="could not save the compile cache.*RuntimeError.*unaffected"):
        assert c.save() is False
    assert c.status == "unused" and not c.path.exists()


def test_save_into_a_dir_that_became_a_file_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"x", None))
    (tmp_path / "zoo").write_text("a file where the cache directory was")
    c = CompileCache(tmp_path / "zoo", FIELDS)
    with pytest.warns(RuntimeWarning, match="could not save the compile cache.*FileExistsError"):
        assert c.save() is False


def test_save_into_an_unwritable_dir_warns_and_leaves_no_temp(tmp_path, monkeypatch):
    # Tests may run as root, which chmod cannot stop: make the write itself fail instead.
    import tempfile

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"x", None))

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    c = CompileCache(tmp_path, FIELDS)
    with pytest.warns(RuntimeWarning, match="could not save the compile cache.*PermissionError"):
        assert c.save() is False
    assert list(tmp_path.iterdir()) == []


def test_load_from_an_unreadable_dir_warns_and_misses(tmp_path, monkeypatch):
    import builtins

    real_open = builtins.open
    c = CompileCache(tmp_path, FIELDS)

    def denied(file, *a, **k):
        if str(file) == str(c.path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", denied)
    with pytest.warns(RuntimeWarning, match="could not read the compile cache.*PermissionError"):
        assert c.load() is False
    assert c.status == "miss"


def test_cache_dir_removed_mid_run_keeps_the_output(tmp_path, fresh_dynamo, monkeypatch):
    # The case, after the build: the cache directory turns into a file between load
    # and the first call's save. The call still returns its output; the save only warns.
    import shutil

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    h = _load_wan(tmp_path)
    shutil.rmtree(tmp_path / "zoo", ignore_errors=True)
    (tmp_path / "zoo").write_text("not a directory any more")
    with pytest.warns(RuntimeWarning, match="could not save the compile cache"):
        out = h(output_type="np", **dict(h.variant.call_defaults, prompt="x", num_inference_steps=1))
    assert out.frames is not None and h.cache.status != "saved"
