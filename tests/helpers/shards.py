"""`pytest --shard K/N` (tests/conftest.py): the K-th of N shards of the collected tests, split
by file, so that a suite too long for one run -- the GPU suite on a machine lent for ten minutes
at a time -- runs as N bounded runs that together are the whole suite."""

from __future__ import annotations


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N) with 1 <= K <= N; a ValueError saying the form otherwise."""
    k, sep, n = text.partition("/")
    if not sep or not k.strip().isdigit() or not n.strip().isdigit() or not 1 <= int(k) <= int(n):
        raise ValueError(f"--shard {text!r}: expected K/N with 1 <= K <= N, e.g. --shard 1/3")
    return int(k), int(n)


def shard_files(files: list[str], k: int, n: int) -> set[str]:
    """The files of shard k of n: the distinct files in sorted order, dealt round-robin. Each
    file stays whole (its module fixtures are built once), every file is in exactly one shard."""
    ordered = sorted(set(files))
    return {f for i, f in enumerate(ordered) if i % n == k - 1}
