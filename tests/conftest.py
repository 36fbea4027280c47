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

import pytest
import torch
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
        mine = shard_files([item.nodeid.split("::")[0] for item in items], k, n)
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid.split("::")[0] not in mine])
        items[:] = [i for i in items if i.nodeid.split("::")[0] in mine]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_dynamo():
    """A clean dynamo cache and zeroed counters, so counts start from nothing."""
    from magi_zoo.engine import counters as compat

    torch.compiler.reset()
    compat.reset_counters()
    yield
    torch.compiler.reset()
