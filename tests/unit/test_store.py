"""Run store: idempotent writes keyed by ids that survive retries; append-only token sequences."""

from __future__ import annotations

from pathlib import Path

import pytest

from store.runstore import RunStore, Segment


def seg(name: str, start: int, ids: list[int], kind: str = "model") -> Segment:
    lp = [-0.5] * len(ids) if kind == "model" else None
    return Segment(name=name, kind=kind, turn=0, start=start, token_ids=ids, logprobs=lp)


def test_segment_write_is_idempotent_and_keeps_the_first(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    first = store.put_segment("run/g/0", seg("t00000.model", 0, [1, 2, 3]))
    again = store.put_segment("run/g/0", seg("t00000.model", 0, [9, 9]))
    assert first.token_ids == again.token_ids == [1, 2, 3]
    assert len(store.segments("run/g/0")) == 1


def test_token_sequence_is_the_concatenation_in_order(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.put_segment("r", seg("prompt", 0, [5, 6], kind="prompt"))
    store.put_segment("r", seg("t00000.model", 2, [7]))
    store.put_segment("r", seg("t00000.obs", 3, [8, 9], kind="observation"))
    assert store.token_ids("r") == [5, 6, 7, 8, 9]


def test_a_growing_context_reads_only_the_new_segments_and_another_store_sees_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = RunStore(tmp_path), RunStore(tmp_path)
    store.put_segment("r", seg("prompt", 0, [5, 6], kind="prompt"))
    assert store.token_ids("r") == [5, 6]
    reads: list[str] = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda p, *a, **k: reads.append(p.name) or real(p, *a, **k))
    other.put_segment("r", seg("t00000.model", 2, [7]))  # written by another worker's store
    other.put_segment("r", seg("t00000.obs", 3, [8], kind="observation"))
    reads.clear()
    context = store.token_ids("r")
    assert context == [5, 6, 7, 8] and len(reads) == 2  # the prompt's blob is not read again
    context.append(99)  # the caller's list is its own
    assert store.token_ids("r") == [5, 6, 7, 8]


def test_a_gap_in_the_sequence_is_an_error(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.put_segment("r", seg("prompt", 0, [5, 6], kind="prompt"))
    store.put_segment("r", seg("t00000.model", 3, [7]))
    with pytest.raises(ValueError, match="starts at 3, not 2"):
        store.token_ids("r")


def _record(rid: str, reward: float) -> dict:
    return {
        "rollout_id": rid,
        "run_id": "run",
        "group_id": "g",
        "task_id": "t",
        "sample_index": 0,
        "env": "math",
        "outcome": "completed",
        "reason": None,
        "reward": reward,
        "scorable": 1,
        "advantage": None,
        "prompt_length": 2,
        "num_tokens": 3,
        "sampling_json": "{}",
        "extra_json": "{}",
    }


def test_rollout_record_is_written_once(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    assert store.put_rollout(_record("run/g/0", 1.0))
    assert not store.put_rollout(_record("run/g/0", 0.0))
    rows = store.rollouts("run")
    assert len(rows) == 1 and rows[0]["reward"] == 1.0


def test_store_is_shared_between_instances(tmp_path: Path) -> None:
    RunStore(tmp_path).register_run("run", "{}", "h")
    assert not RunStore(tmp_path).register_run("run", '{"x": 1}', "h2")
    assert RunStore(tmp_path).get_run("run")["config_hash"] == "h"
