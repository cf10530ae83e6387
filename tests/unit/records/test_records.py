"""Export records: typed models, committed JSON Schemas, schema_version in every line, no leaked keys.

Drives the real export on a temp RunStore written through its public methods, and validates the lines with
the ``jsonschema`` package against the committed ``records/schema/*.json`` (the integration helper
``assert_schema_valid`` is the one the real-run tests use).
"""

from __future__ import annotations

import importlib
import io
import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator  # type: ignore[import-untyped]

from durable_rollouts.records.export import export_run, group_record, iter_run, rollout_record
from durable_rollouts.records.record import (
    RECORDS,
    ROLLOUT_OPTIONAL,
    SCHEMA_DIR,
    SCHEMA_VERSION,
    RolloutRecord,
    SamplingRecord,
    committed_schema,
    schema_text,
)
from durable_rollouts.records.schema.__main__ import main as schema_main
from durable_rollouts.store.runstore import RunStore, Segment

RUN = "rec"
SAMPLING = {
    "temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 3,
    "logprob_mode": "processed_logprobs", "min_tokens": 0,
}  # fmt: skip
LINEAGE = {
    "policy_versions": ["v1"], "config_hash": "h", "env": "math", "env_version": "1",
    "verifier_version": "1", "sandbox_image": None,
}  # fmt: skip
OPTIONAL = {
    "sandbox_replays": 1, "sandbox_slot_waits": 2, "partial_steps": 3, "engine_failovers": 1,
    "reprefill_tokens": 40, "score_truncated": True, "wasted_tokens": 5, "superseded_by": "rec/g0/0r1",
    "sequences": [{"start": 6, "call": 1, "at_message": 0, "why": "message 0 differs"}],
}  # fmt: skip


def put_rollout(store: RunStore, k: int, extra: dict, outcome: str = "completed", turns: int = 2) -> str:
    """One finalized rollout of group g0: a 3-token prompt, then per turn 2 sampled tokens and 1 observed."""
    rid = f"{RUN}/g0/{k}"
    store.put_segment(rid, Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=[1, 2, 3]))
    pos = 3
    for t in range(turns):
        meta = {"engine": "http://e", "finish_reason": "stop", "queue_s": 0.01, "model_s": 0.2, "attempt": 1}
        sampled = Segment(name=f"t{t:05d}.model", kind="model", turn=t, start=pos, token_ids=[5, 6],
                          logprobs=[-0.5, -1.25], policy_versions=["v1", "v1"], meta=meta)  # fmt: skip
        store.put_segment(rid, sampled)
        store.put_segment(rid, Segment(name=f"t{t:05d}.obs", kind="observation", turn=t, start=pos + 2,
                                       token_ids=[7]))  # fmt: skip
        pos += 3
    scorable = outcome == "completed"
    store.put_rollout({
        "rollout_id": rid, "run_id": RUN, "group_id": "g0", "task_id": "t1", "sample_index": k, "env": "math",
        "outcome": outcome, "reason": None if scorable else "admission", "reward": 1.0 if scorable else None,
        "scorable": int(scorable), "advantage": 0.0 if scorable else None, "prompt_length": 3,
        "num_tokens": pos, "sampling_json": json.dumps(SAMPLING), "extra_json": json.dumps(extra),
    })  # fmt: skip
    return rid


def put_group(store: RunStore) -> None:
    store.put_group(RUN, "g0", "t1", {
        "run_id": RUN, "group_id": "g0", "task_id": "t1", "size": 2, "scorable": 1, "failed": 0,
        "reward_mean": 1.0, "reward_std": 0.0, "zero_variance": True,
        "outcomes": {"completed": 1, "cancelled": 1}, "admission_cancelled": 1, "wasted_tokens": 4,
    })  # fmt: skip


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    store = RunStore(tmp_path)
    store.register_run(RUN, json.dumps({"run": {"env": "math"}}), "h")
    put_rollout(store, 0, {**OPTIONAL, "lineage": LINEAGE, "debug_note": "x", "workflow_private": {"a": 1}})
    put_rollout(store, 1, {"lineage": LINEAGE}, outcome="cancelled", turns=1)
    put_group(store)
    return store


def validators() -> dict[str, Draft202012Validator]:
    return {kind: Draft202012Validator(committed_schema(kind)) for kind in RECORDS}


def test_the_committed_schemas_are_what_the_models_generate() -> None:
    for kind in RECORDS:
        path = SCHEMA_DIR / f"{kind}.json"
        assert path.read_text() == schema_text(kind), (
            f"{path} is stale: run python -m durable_rollouts.records.schema"
        )
        Draft202012Validator.check_schema(committed_schema(kind))
    assert schema_main(["--check"]) == 0
    assert committed_schema("rollout")["properties"]["schema_version"]["const"] == SCHEMA_VERSION


def test_every_exported_line_validates_and_carries_the_schema_version(store: RunStore) -> None:
    buf = io.StringIO()
    assert export_run(store, RUN, buf) == {"rollout": 2, "group": 1}
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    check = validators()
    for obj in lines:
        assert obj["schema_version"] == SCHEMA_VERSION
        assert list(check[obj["kind"]].iter_errors(obj)) == [], obj.get("rollout_id", obj["kind"])
    first, cancelled, group = lines
    assert {k: first[k] for k in ROLLOUT_OPTIONAL} == OPTIONAL
    assert first["lineage"] == LINEAGE and first["sampling"] == SAMPLING
    assert first["turns"][1] == {
        "turn": 1, "engine": "http://e", "finish_reason": "stop", "range": [6, 8], "queue_s": 0.01,
        "model_s": 0.2, "env_s": 0.0, "reward_s": 0.0, "attempt": 1,
    }  # fmt: skip
    assert cancelled["outcome"] == "cancelled" and cancelled["reward"] is None
    assert (group["admission_cancelled"], group["wasted_tokens"]) == (1, 4)


def test_unknown_extra_keys_stay_in_the_store_and_are_not_exported(store: RunStore) -> None:
    rid = f"{RUN}/g0/0"
    rec = rollout_record(store, store.rollout(rid))  # type: ignore[arg-type]
    assert "debug_note" not in rec and "workflow_private" not in rec
    stored = json.loads(store.rollout(rid)["extra_json"])  # type: ignore[index]
    assert stored["debug_note"] == "x" and stored["workflow_private"] == {"a": 1}


def test_absent_optional_fields_stay_absent_and_mean_their_default(store: RunStore) -> None:
    rec = rollout_record(store, store.rollout(f"{RUN}/g0/1"))  # type: ignore[arg-type]
    assert not set(ROLLOUT_OPTIONAL) & rec.keys()  # readers see what was stored, nothing invented
    model = RolloutRecord.model_validate(rec)
    assert (model.engine_failovers, model.wasted_tokens, model.score_truncated) == (0, 0, None)


def test_key_order_is_todays_with_schema_version_first(store: RunStore) -> None:
    rec = rollout_record(store, store.rollout(f"{RUN}/g0/0"))  # type: ignore[arg-type]
    keys = list(rec)
    assert keys[0] == "schema_version" and keys[1 : 1 + len(ROLLOUT_OPTIONAL)] == list(ROLLOUT_OPTIONAL)
    assert keys[1 + len(ROLLOUT_OPTIONAL) :][:2] == ["kind", "run_id"] and keys[-1] == "lineage"
    (group,) = [r for r in iter_run(store, RUN) if r["kind"] == "group"]
    assert list(group)[:2] == ["schema_version", "kind"]


def test_the_schema_rejects_leaked_keys_and_lines_without_a_version(store: RunStore) -> None:
    check = validators()["rollout"]
    rec = rollout_record(store, store.rollout(f"{RUN}/g0/0"))  # type: ignore[arg-type]
    assert not check.is_valid({**rec, "debug_note": "x"})
    assert not check.is_valid({k: v for k, v in rec.items() if k != "schema_version"})
    assert not check.is_valid({**rec, "schema_version": SCHEMA_VERSION + 1})
    assert not check.is_valid({**rec, "loss_mask": [2] * len(rec["loss_mask"])})
    group = group_record(store.groups(RUN)[0])
    assert not validators()["group"].is_valid({**group, "kind": "rollout"})


def test_a_record_that_breaks_the_model_is_not_exported(store: RunStore) -> None:
    put_rollout(store, 2, {"lineage": LINEAGE, "engine_failovers": "twice"})
    with pytest.raises(ValueError, match="engine_failovers"):
        rollout_record(store, store.rollout(f"{RUN}/g0/2"))  # type: ignore[arg-type]


def test_the_sampling_record_declares_every_sampling_parameter() -> None:
    """A new sampling parameter must be declared here too, or export would reject every record."""
    for name in (
        "durable_rollouts.contracts.types",
        "workflows.types",
    ):  # the activity types' module, before and after the move
        try:
            params = importlib.import_module(name).SamplingParams
            break
        except ImportError:
            continue
    assert set(params.model_fields) <= set(SamplingRecord.model_fields)


def test_the_integration_helper_accepts_real_lines_and_names_the_first_violation(store: RunStore) -> None:
    from tests.integration.support import assert_schema_valid, export_lines

    lines = export_lines(store, RUN)
    assert len(lines) == 3
    assert_schema_valid(lines)
    assert_schema_valid([json.loads(line) for line in lines])
    bad = json.loads(lines[0]) | {"debug_note": "x"}
    with pytest.raises(AssertionError, match=rf"line 0 \(rollout {RUN}/g0/0\).*debug_note"):
        assert_schema_valid([bad])
    with pytest.raises(AssertionError, match="unknown kind"):
        assert_schema_valid([{"kind": "batch"}])
