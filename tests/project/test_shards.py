"""`pytest --shard K/N`: N runs that together are the whole suite, each file in one of them."""

import subprocess
import sys

import pytest

from helpers import REPO
from helpers.shards import parse_shard, shard_files


def test_shards_partition_the_files():
    files = [f"tests/x/test_{c}.py" for c in "fbdaec"] * 2  # several tests per file
    shards = [shard_files(files, k, 3) for k in (1, 2, 3)]
    assert set().union(*shards) == set(files) and sum(len(s) for s in shards) == 6  # all, none twice
    assert [len(s) for s in shards] == [2, 2, 2]
    assert shard_files(files, 1, 1) == set(files)


@pytest.mark.parametrize("bad", ["3", "0/2", "3/2", "a/b", "1/"])
def test_a_bad_shard_says_the_form(bad):
    with pytest.raises(ValueError, match=r"expected K/N with 1 <= K <= N, e.g. --shard 1/3"):
        parse_shard(bad)


def test_the_option_deselects_the_other_shards_files():
    """Collection only (no test runs), on two small test files: shard 2 of 2 keeps the second
    file's tests and none of the first's."""
    files = ["tests/project/test_shards.py", "tests/specs/test_gpu_profiles.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *files,
                          "--shard", "2/2"], cwd=REPO, capture_output=True, text=True)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert ids and {i.split("::")[0] for i in ids} == {files[1]}, out.stdout + out.stderr
    assert "deselected" in out.stdout, out.stdout
