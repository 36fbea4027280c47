"""Shared test setup: offline, CPU, quiet, and helpers to read compile counters."""

import os
import sys
from pathlib import Path

# The shared helpers live in tests/helpers (`from helpers.fusion import ...`).
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Nothing in the suite may reach a hub: fail loudly instead of downloading.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread per test process, and in the processes tests start (an explicit
# OMP_NUM_THREADS wins). `-n auto` runs one worker per core, and torch's default is one
# thread per core in each of them; CI also runs its newest-torch stage beside the two workers.
# On 2 cores that is 6 threads whose OpenMP spin-waits take the cores from each other, and the
# tiny models gain nothing from a second thread. Measured with three concurrent pytest runs,
# as in CI, on a 2-core machine: tests/models/wan, 3 files of tests/engine, and tests/models/flux
# + self_forcing, each with an empty inductor dir: all three done in 99 s against 200 s with
# the default, then 167 s against 191 s under other load (noisy: others share the machine).
# Where compiling dominates the gain is small: tests/conformance/test_conformance.py, tests/cli
# and 4 tests/engine files side by side took 257 s both ways, the last two 8% and 12% sooner.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from helpers.card_lock import card_lock
from helpers.shards import parse_shard, shard_files

torch.manual_seed(0)


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N shards of the collected tests, split by file (e.g. the GPU suite "
                          "as N runs of bounded time: -m gpu --shard 1/3)")


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if shard is not None:
        try:
            k, n = parse_shard(shard)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        files = [item.nodeid.split("::")[0] for item in items]
        mine = shard_files(files, k, n)
        config.hook.pytest_deselected(items=[i for i, f in zip(items, files) if f not in mine])
        items[:] = [i for i, f in zip(items, files) if f in mine]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# GPU tests share one card across xdist workers (`-m gpu -n 3`). A test that compares forward
# times (marked `gpu_timing`) takes the card to itself: at 46fb748 on an H200 the fused LoRA's
# forward read 3.5% slower than the base's (gate 3%) while two other workers' tests ran beside
# it; with the card to itself, beside the same workers, it passed (c1ac70f). Every other GPU test
# takes the card shared. The turnstile keeps
# a waiting timing test from starving: while it waits, no new test takes the card shared, so it
# waits only for the tests already running (flock alone gives a waiting writer no priority).
CARD_LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "magi_zoo_gpu_tests.lock"


@pytest.fixture(autouse=True)
def _card_to_itself_when_timing(request):
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    with card_lock(CARD_LOCK, exclusive="gpu_timing" in request.keywords):
        yield


@pytest.fixture
def fresh_dynamo():
    """A clean dynamo cache and zeroed counters, so counts start from nothing."""
    from magi_zoo.engine import counters as compat

    torch.compiler.reset()
    compat.reset_counters()
    yield
    torch.compiler.reset()
