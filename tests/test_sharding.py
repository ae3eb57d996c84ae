"""ENTROPY_ATTN_TEST_SHARD (tests/conftest.py): n processes with shards 0/n .. n-1/n run every
collected test exactly once (scripts/gpu_suite.sh runs the suite so on a GPU machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Optional

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGET = os.path.join(HERE, "test_policy.py")


def collected(shard: Optional[str]) -> List[str]:
    """The test ids pytest collects from TARGET under the given shard spec (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "ENTROPY_ATTN_TEST_SHARD"}
    if shard is not None:
        env["ENTROPY_ATTN_TEST_SHARD"] = shard
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", TARGET],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def test_shards_partition_the_collection() -> None:
    """Three shards: disjoint, non-empty, and together the whole collection in its order."""
    whole = collected(None)
    assert len(whole) >= 3
    shards = [collected(f"{k}/3") for k in range(3)]
    assert all(shards), "an empty shard"
    assert sorted(sum(shards, [])) == sorted(whole)
    assert len(set(sum(shards, []))) == len(whole)
    assert shards[0] == whole[0::3]


@pytest.mark.parametrize("spec", ["3/3", "a/b"])
def test_bad_shard_spec_is_a_usage_error(spec: str) -> None:
    """A malformed spec stops pytest with a message naming the variable (not a silent full run)."""
    env = dict(os.environ, ENTROPY_ATTN_TEST_SHARD=spec)
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", TARGET],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode != 0
    assert "ENTROPY_ATTN_TEST_SHARD" in res.stdout + res.stderr
