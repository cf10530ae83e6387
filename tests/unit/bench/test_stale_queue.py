"""The stale-queue workbench on tiny configurations: the books balance for every policy, and adaptive
admission gets a larger fraction of its generated tokens into an update than the unbounded baseline.

With over-provisioning, late groups are kept (none dropped for lateness, batches not skewed short), where
aborting them skews the consumed length mix short. Virtual time only (simengine's step model, a real
RunStore and TrainerFeed); nothing here is timed.
"""

from __future__ import annotations

from pathlib import Path

from bench.stale_queue import RUN, Fleet, Trainer, Workload, run_all
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.trainer.feed import TrainerFeed

WORKLOAD = Workload(group_size=2, median_tokens=48, task_tokens=(32, 64), system_tokens=32, seed=3)
FLEET = Fleet(replicas=2, kv_blocks=512, block_size=16, max_num_seqs=16)
TRAINER = Trainer(batch_groups=2, step_s=2.0, steps=4, max_lag=1)


def test_books_balance_and_adaptive_admission_beats_the_unbounded_queue(tmp_path: Path) -> None:
    results = {r.policy: r for r in run_all(WORKLOAD, FLEET, TRAINER, [2], tmp_path)}
    assert set(results) == {"baseline", "fixed-4", "adaptive"}
    for r in results.values():
        assert r.balanced, r.policy
        for unit in ("records", "tokens"):
            parts = r.consumed[unit] + r.discarded[unit] + r.waiting[unit]
            assert r.generated[unit] == parts, (r.policy, unit)
        # the trainer got its full batches every step: the same trainer capacity for every policy
        assert r.trainer_steps == TRAINER.steps
        assert r.consumed["records"] == TRAINER.steps * TRAINER.batch_groups * WORKLOAD.group_size
        assert r.tokens_reaching_update == r.consumed["tokens"] / r.generated["tokens"]
    base, adaptive = results["baseline"], results["adaptive"]
    assert base.discarded["tokens"] > 0, "the fleet outruns the trainer, so the unbounded queue goes stale"
    assert adaptive.tokens_reaching_update > base.tokens_reaching_update
    assert adaptive.generated["tokens"] < base.generated["tokens"]
    # the books the workbench reports are the feed's own, read back from the store it wrote
    store = RunStore(tmp_path / "adaptive-0-lag1")
    ledger = TrainerFeed(store, RUN).ledger()
    assert ledger.balanced and ledger.consumed.tokens == adaptive.consumed["tokens"]
    versions = [p["version"] for p in store.policies()]
    assert versions == [f"v{k}" for k in range(TRAINER.steps + 1)]  # published in order, one per step


TAILED = Workload(
    group_size=4, median_tokens=48, task_tokens=(32, 64), system_tokens=32, seed=3, tail_fraction=0.1
)
SMALL = Fleet(replicas=2, kv_blocks=1024, block_size=16, max_num_seqs=16)
STEPS = Trainer(batch_groups=4, step_s=2.0, steps=8, max_lag=1)


def test_over_provisioning_keeps_late_groups_and_does_not_skew_batches_short(tmp_path: Path) -> None:
    results = {r.policy: r for r in run_all(TAILED, SMALL, STEPS, [], tmp_path, overprovision=(2,))}
    assert set(results) == {"baseline", "adaptive", "sync", "sync +2", "sync +2 drop", "fixed-4 +2"}
    for r in results.values():
        assert r.balanced and r.trainer_steps == STEPS.steps, r.policy
        # every admitted group is a record (complete), still generating, or (drop only) aborted
        assert r.groups_admitted == r.groups_complete + r.in_flight_groups + r.aborted_groups, r.policy
        assert all(why.startswith("stale:") for why in r.discard_reasons), r.policy  # never for lateness
    sync, keep, drop = results["sync"], results["sync +2"], results["sync +2 drop"]
    assert keep.aborted_groups == 0 and drop.aborted_groups > 0
    # the extra groups spare the trainer the wait for each batch's slowest group
    assert keep.trainer_idle_fraction < sync.trainer_idle_fraction
    # aborting the late groups skews the batches toward short rollouts; keeping them does not
    ratio = {k: r.consumed_mix["mean"] / r.admitted_mix["mean"] for k, r in results.items()}
    assert ratio["sync"] == 1.0  # everything admitted was consumed
    assert ratio["sync +2 drop"] < 0.9 < ratio["sync +2"]
    assert keep.consumed_mix["p90"] > drop.consumed_mix["p90"]
