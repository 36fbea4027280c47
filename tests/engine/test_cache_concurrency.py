"""Several processes sharing one compile-cache directory: writing the same key and their own
keys at once, and reading everything while others write, never corrupt or lose an entry.

torch's artifact serializer is stubbed in the workers (each save returns fresh random bytes,
whose sha256 the worker records): what is under test is the file protocol (unique temp
names, atomic rename, checksums, the reader's guarded unlink), not torch's payload; the real
round trip is test_cache.py::test_warm_start_hits_in_fresh_process.
"""

import hashlib
import multiprocessing as mp
import os

import pytest
import torch

from magi_zoo.engine.compile.cache import CompileCache

N_PROCS = 4
ROUNDS = 12
SHARED = {"model": "test/shared"}


def _own(i: int) -> dict:
    return {"model": f"test/own-{i}"}


def _worker(directory, i, barrier, results):
    import torch

    written = {"shared": [], "own": []}
    state = {}

    def fake_save():
        # distinct bytes per process and per save; sizes vary so writes take different times
        payload = os.urandom(200_000 + 37_000 * i + 1_000 * state["round"])
        state["sha"] = hashlib.sha256(payload).hexdigest()
        return payload, None

    torch.compiler.save_cache_artifacts = fake_save
    torch.compiler.load_cache_artifacts = lambda payload: object()  # any intact payload "loads"
    problems = []
    barrier.wait()  # start together, to overlap as much as possible
    for r in range(ROUNDS):
        state["round"] = r
        for name, fields in (("shared", SHARED), ("own", _own(i))):
            if not CompileCache(directory, fields).save():
                problems.append(f"save {name} round {r} failed")
            written[name].append(state["sha"])
        # read every entry while the others write: an entry is either absent or intact
        for fields in (SHARED, *(_own(j) for j in range(N_PROCS))):
            c = CompileCache(directory, fields)
            if c.load() is False and c.status != "miss":
                problems.append(f"load {fields} gave {c.status}")
    results.put((i, written, problems))


def test_processes_sharing_a_cache_dir_never_corrupt_or_lose_entries(tmp_path):
    ctx = mp.get_context("fork")  # inherits the imported torch: no per-process import cost
    barrier, results = ctx.Barrier(N_PROCS), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(tmp_path, i, barrier, results)) for i in range(N_PROCS)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [problems for _, _, problems in got] == [[]] * N_PROCS  # no load ever saw a bad file
    by_proc = {i: written for i, written, _ in got}
    # Own keys: one writer each, so the entry is that writer's last save, intact.
    for i, written in by_proc.items():
        payload = CompileCache(tmp_path, _own(i))._read()[0]  # raises on a bad checksum
        assert hashlib.sha256(payload).hexdigest() == written["own"][-1]
    # The shared key: the complete bytes of one of the 4 x 12 = 48 saves, and in fact one of
    # the 4 final ones (a writer's last save may be overtaken only by another's last save or
    # an earlier one of a slower writer, so only "some save" is guaranteed; assert that).
    shared = hashlib.sha256(CompileCache(tmp_path, SHARED)._read()[0]).hexdigest()
    assert shared in {sha for w in by_proc.values() for sha in w["shared"]}
    # 1 shared + 4 own entries, and no temp file left behind.
    names = sorted(f.name for f in tmp_path.iterdir())
    assert len(names) == 1 + N_PROCS and all(n.endswith(".bin") and not n.startswith(".") for n in names)


def _save(directory, fields, payload):
    orig = torch.compiler.save_cache_artifacts
    torch.compiler.save_cache_artifacts = lambda: (payload, None)
    try:
        assert CompileCache(directory, fields).save()
    finally:
        torch.compiler.save_cache_artifacts = orig


def test_reader_never_deletes_a_fresh_entry_written_after_its_read(tmp_path, monkeypatch):
    # Process A reads an entry torch rejects; before A removes it, process B renames a fresh,
    # valid entry into place. A must remove only the file it read -- here, nothing.
    _save(tmp_path, SHARED, b"not torch artifacts")
    fresh = b"fresh artifacts from another process"

    def rejecting_load(payload):
        _save(tmp_path, SHARED, fresh)  # "process B" writes between A's read and A's unlink
        return None  # torch could not deserialize A's bytes: A treats its entry as corrupt

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", rejecting_load)
    a = CompileCache(tmp_path, SHARED)
    with pytest.warns(RuntimeWarning, match="ignoring corrupt"):
        assert a.load() is False
    assert a.status == "rebuilt"
    assert CompileCache(tmp_path, SHARED)._read()[0] == fresh  # B's entry survived A's cleanup


def test_bad_entry_still_removed_when_nobody_replaced_it(tmp_path, monkeypatch):
    _save(tmp_path, SHARED, b"not torch artifacts")
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda payload: None)
    a = CompileCache(tmp_path, SHARED)
    with pytest.warns(RuntimeWarning, match="ignoring corrupt"):
        assert a.load() is False
    assert not a.path.exists()  # same inode as read: removed, so the next load is a clean miss
