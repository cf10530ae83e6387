"""Lineage: every record links its policy versions, config hash, env and verifier versions (and image).

Drives the real finalize activity and the real export on a temp RunStore; the reproduce checks here are the
ones that need no engine (bad input is one line naming the run, rollout and field).
"""

from __future__ import annotations

import json
from pathlib import Path

import coding_env
import math_env
import pytest

from durable_rollouts.activities.rollout import RolloutActivities
from durable_rollouts.cli.reproduce import ReproduceError, Reproduction, reproduce
from durable_rollouts.config.load import config_hash, load_config
from durable_rollouts.contracts.activity_io import FinalizeRolloutInput
from durable_rollouts.contracts.types import Outcome, RolloutState, SamplingParams
from durable_rollouts.records.export import rollout_record, versions_in_order
from durable_rollouts.store.runstore import RunStore, Segment

RUN = "lin"
SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, seed=7, logprob_mode="processed_logprobs"
)


def register(store: RunStore, env: str = "math", image: str | None = None) -> str:
    overrides = [f"run.env={json.dumps(env)}"]
    if image:
        overrides.append(f"sandbox.image={json.dumps(image)}")
    cfg = load_config(None, overrides)
    digest = config_hash(cfg)
    store.register_run(RUN, cfg.model_dump_json(), digest)
    return digest


def put_turns(store: RunStore, rid: str, turns: list[list[str | None]]) -> None:
    store.put_segment(rid, Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=[1, 2, 3]))
    pos = 3
    for t, versions in enumerate(turns):
        ids = [10 + i for i in range(len(versions))]
        store.put_segment(rid, Segment(name=f"t{t:05d}.model", kind="model", turn=t, start=pos, token_ids=ids,
                                       logprobs=[-0.5] * len(ids), policy_versions=versions))  # fmt: skip
        pos += len(ids)
        store.put_segment(
            rid, Segment(name=f"t{t:05d}.obs", kind="observation", turn=t, start=pos, token_ids=[7])
        )
        pos += 1


async def finalize(store: RunStore, rid: str, env: str = "math") -> None:
    acts = RolloutActivities(store, engine=None)  # type: ignore[arg-type]  # finalize never calls it
    inp = FinalizeRolloutInput(
        run_id=RUN, group_id="g000000", rollout_id=rid, task_id="t1", sample_index=0, env=env,
        outcome=Outcome.COMPLETED, reason=None, reward=1.0, scorable=True, sampling=SAMPLING, turns=2,
        state=RolloutState(engine_failovers=1),
    )  # fmt: skip
    assert await acts.finalize_rollout(inp)


def test_versions_are_listed_in_order_of_first_use() -> None:
    segs = [
        Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=[1]),
        Segment(name="a", kind="model", turn=0, start=1, token_ids=[1, 2, 3],
                policy_versions=["v2", "v2", "v3"]),
        Segment(name="o", kind="observation", turn=0, start=4, token_ids=[5]),
        Segment(name="b", kind="model", turn=1, start=5, token_ids=[1, 2], policy_versions=[None, "v1"]),
    ]  # fmt: skip
    assert versions_in_order(segs) == ["v2", "v3", "v1"]  # not sorted: v1 came last


async def test_finalize_stores_lineage_and_export_carries_it(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    digest = register(store)
    rid = f"{RUN}/g000000/0"
    put_turns(store, rid, [["v1", "v1", "v2"], ["v2", "v3"]])
    await finalize(store, rid)
    stored = json.loads(store.rollout(rid)["extra_json"])  # type: ignore[index]
    want = {
        "policy_versions": ["v1", "v2", "v3"],
        "config_hash": digest,
        "env": "math",
        "env_version": math_env.ENV_VERSION,
        "verifier_version": math_env.VERIFIER_VERSION,
        "sandbox_image": None,
    }
    assert stored["lineage"] == want and stored["engine_failovers"] == 1
    rec = rollout_record(store, store.rollout(rid))  # type: ignore[arg-type]
    assert rec["lineage"] == want
    assert rec["engine_failovers"] == 1  # the workflow's extra fields still export beside the lineage
    # the per-token contract is untouched
    assert rec["policy_versions"] == [None] * 3 + ["v1", "v1", "v2", None, "v2", "v3", None]
    assert len(rec["token_ids"]) == len(rec["policy_versions"]) == len(rec["loss_mask"]) == 10


async def test_coding_lineage_names_the_sandbox_image_of_the_stored_config(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    register(store, env="coding", image="my-tasks:2024-05")
    rid = f"{RUN}/g000000/0"
    put_turns(store, rid, [["v0"]])
    await finalize(store, rid, env="coding")
    lineage = rollout_record(store, store.rollout(rid))["lineage"]  # type: ignore[arg-type]
    assert lineage["sandbox_image"] == "my-tasks:2024-05"
    assert lineage["env_version"] == coding_env.ENV_VERSION
    assert lineage["verifier_version"] == coding_env.VERIFIER_VERSION
    assert coding_env.VERIFIER_VERSION != math_env.VERIFIER_VERSION


def test_a_record_stored_before_lineage_exports_what_the_store_knows_and_nulls_the_rest(
    tmp_path: Path,
) -> None:
    store = RunStore(tmp_path)
    digest = register(store)
    rid = f"{RUN}/g000000/0"
    put_turns(store, rid, [["v0", "v1"]])
    store.put_rollout({
        "rollout_id": rid, "run_id": RUN, "group_id": "g000000", "task_id": "t1", "sample_index": 0,
        "env": "math", "outcome": "completed", "reason": None, "reward": 1.0, "scorable": 1,
        "advantage": None, "prompt_length": 3, "num_tokens": 6, "sampling_json": SAMPLING.model_dump_json(),
        "extra_json": "{}",
    })  # fmt: skip
    lineage = rollout_record(store, store.rollout(rid))["lineage"]  # type: ignore[arg-type]
    assert lineage["policy_versions"] == ["v0", "v1"] and lineage["config_hash"] == digest
    assert lineage["env_version"] is None and lineage["verifier_version"] is None  # never guessed


async def test_reproduce_refuses_bad_input_with_one_line_naming_the_rollout_and_field(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    with pytest.raises(ReproduceError, match=r"^run lin: not in the store"):
        reproduce(store, RUN, "lin/g000000/0")
    register(store)
    with pytest.raises(ReproduceError, match=r"^run lin, rollout lin/g000000/9: no such rollout record$"):
        reproduce(store, RUN, "lin/g000000/9")
    rid = f"{RUN}/g000000/0"
    store.put_segment(rid, Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=[1, 2, 3]))
    await finalize(store, rid)
    with pytest.raises(ReproduceError) as e:
        reproduce(store, RUN, rid)
    assert "\n" not in str(e.value) and "rollout lin/g000000/0" in str(e.value)
    assert "first model call (segment 't00000.model')" in str(e.value)


def test_the_verdict_is_one_line_and_names_every_mismatch() -> None:
    base = dict(run_id=RUN, rollout_id="r", engine_url="http://e", engine_version="v0", seed=7,
                recorded=[1, 2, 3], reproduced_versions=["v0"] * 3, max_logprob_diff=0.0)  # fmt: skip
    same = Reproduction(**base, reproduced=[1, 2, 3])
    assert (
        same.ok
        and same.line() == "rollout r: reproduced: 3/3 token ids equal (engine http://e serving v0, seed 7)"
    )
    differs = Reproduction(**base, reproduced=[1, 5, 3])
    assert not differs.ok and "token ids differ at 1 of 3 (recorded 2, reproduced 5)" in differs.line()
    short = Reproduction(**base, reproduced=[1, 2])
    assert short.first_difference() == 2 and "recorded 3, reproduced end" in short.line()
    lineage = Reproduction(
        **base, reproduced=[1, 2, 3],
        mismatches=["policy version: recorded v0, engine serves v9", "verifier_version: recorded a, now b"],
    )  # fmt: skip
    line = lineage.line()
    assert not lineage.ok and "\n" not in line
    assert line.startswith("rollout r: lineage mismatch: policy version: recorded v0, engine serves v9; ")
    assert "verifier_version: recorded a, now b" in line
