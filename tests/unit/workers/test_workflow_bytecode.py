"""The worker writes its workflow modules' bytecode: the SDK's sandbox re-imports a workflow's module for
every workflow run, and without a cache compiles its source each time (``workers.worker``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from durable_rollouts.workers.worker import WORKFLOWS, cache_workflow_bytecode


def _caches() -> list[Path]:
    out = []
    for module in sorted({w.__module__ for w in WORKFLOWS}):
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None
        out.append(Path(importlib.util.cache_from_source(spec.origin)))
    return out


def test_missing_or_stale_caches_are_written_and_fresh_ones_left_alone() -> None:
    caches = _caches()
    assert len(caches) == 3  # run, group, rollout
    cache_workflow_bytecode()
    caches[0].unlink()
    os.utime(caches[1], (0, 0))  # stale: older than its source
    written = cache_workflow_bytecode()
    assert written == 2 and all(c.exists() for c in caches)
    # each loads as a valid cache of its source
    for c in caches:
        assert c.read_bytes()[:4] == importlib.util.MAGIC_NUMBER
    assert cache_workflow_bytecode() == 0  # all fresh now: nothing rewritten
