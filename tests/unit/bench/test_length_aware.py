"""Length-aware groups (bench/length_aware.py): every member starts once and ends once, never before its
group is admitted, never beyond the allowance; siblings drain longest-predicted first and before new
groups' probes; a failed or cancelled probe still releases its group. And the simulated engine's task-level
length correlation (``random_task_sigma``, ``random_tail_key = "task"``) that the benchmark relies on."""

from __future__ import annotations

import ast
import math
import random
import statistics
from pathlib import Path

import pytest

import bench.length_aware
from bench.length_aware import (
    GroupOffer,
    LengthAwareConfig,
    LengthAwareScheduler,
    LengthAwareState,
    Outcome,
    Plan,
)
from durable_rollouts.simengine import PolicyName, SimSettings
from durable_rollouts.simengine.policies import heavy_tail_length

ON = LengthAwareConfig(enabled=True)


def offers(first: int, n: int, size: int = 4) -> list[GroupOffer]:
    return [GroupOffer(group_id=f"g{i:03d}", size=size) for i in range(first, first + n)]


def members(plan: Plan) -> list[tuple[str, int]]:
    return [(s.group_id, s.member) for s in plan.starts]


def probe_and_finish(sched: LengthAwareScheduler, lengths: list[int], size: int = 4) -> list[str]:
    """Admit one group per length with its probe, then finish each probe with that length."""
    wave = sched.config.probe
    plan = sched.plan(len(lengths) * wave, offers(0, len(lengths), size))
    assert [s.wave for s in plan.starts] == ["probe"] * len(lengths) * wave
    for s in plan.starts:
        sched.end(s.group_id, s.member, "finished", lengths[int(s.group_id[1:])])
    return plan.admitted


def simulate(config: LengthAwareConfig, seed: int, groups: int = 40) -> list[Plan]:
    """A seeded random dispatcher loop run to the end; checks the invariants on every step."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 8) for _ in range(groups)]
    sched = LengthAwareScheduler(config)
    admitted: set[str] = set()
    started: dict[tuple[str, int], int] = {}
    running: list[tuple[str, int]] = []
    complete: set[str] = set()
    plans = []
    nxt = 0
    for _ in range(10_000):
        if len(complete) == groups:
            break
        allowed = rng.randint(0, 6)
        offered = [GroupOffer(group_id=f"g{i:03d}", size=sizes[i]) for i in range(nxt, min(groups, nxt + 3))]
        load = {"r0": rng.random(), "r1": rng.random()}
        plan = sched.plan(allowed, offered, load)
        plans.append(plan)
        assert len(plan.starts) <= allowed
        assert [o.group_id for o in offered[: len(plan.admitted)]] == plan.admitted
        nxt += len(plan.admitted)
        admitted |= set(plan.admitted)
        for s in plan.starts:
            assert s.group_id in admitted, "started before its group was admitted"
            key = (s.group_id, s.member)
            assert key not in started, f"{key} started twice"
            assert 0 <= s.member < sizes[int(s.group_id[1:])]
            started[key] = len(plans)
            running.append(key)
        rng.shuffle(running)
        for _ in range(rng.randint(0, len(running))):
            gid, m = running.pop()
            outcomes: list[Outcome] = ["finished", "failed", "cancelled"]
            outcome = rng.choices(outcomes, [8, 1, 1])[0]
            if sched.end(gid, m, outcome, rng.randint(1, 5000)):
                assert gid not in complete
                complete.add(gid)
    assert len(complete) == groups, "some group never completed: a member was lost"
    assert set(started) == {(f"g{i:03d}", m) for i in range(groups) for m in range(sizes[i])}
    assert sched.state.groups == {} and sched.held() == 0
    return plans


@pytest.mark.parametrize(
    "config",
    [
        LengthAwareConfig(),
        ON,
        LengthAwareConfig(enabled=True, probe=2, predictor="mean"),
        LengthAwareConfig(enabled=True, probe=3, release="progress", long_factor=1.5),
        LengthAwareConfig(enabled=True, max_held=5),
    ],
    ids=["off", "on", "probe2-mean", "probe3-progress-hint", "max-held"],
)
@pytest.mark.parametrize("seed", range(5))
def test_every_member_starts_once_and_ends_once(config: LengthAwareConfig, seed: int) -> None:
    simulate(config, seed)


def test_same_inputs_same_plans_and_the_state_survives_serialization() -> None:
    cfg = LengthAwareConfig(enabled=True, probe=2, long_factor=1.2)
    assert simulate(cfg, 7) == simulate(cfg, 7)
    a = LengthAwareScheduler(cfg)
    probe_and_finish(a, [300, 100, 900])
    b = LengthAwareScheduler(cfg, LengthAwareState.model_validate_json(a.state.model_dump_json()))
    load = {"r0": 10.0, "r1": 0.0}
    assert a.plan(5, offers(3, 2), load) == b.plan(5, offers(3, 2), load)
    assert a.state == b.state


def test_nothing_starts_beyond_the_allowance() -> None:
    sched = LengthAwareScheduler(ON)
    assert sched.plan(0, offers(0, 5)).starts == []
    assert sched.plan(-3, offers(0, 5)).starts == []
    probe_and_finish(sched, [50, 60])
    assert len(sched.plan(4, offers(2, 5)).starts) == 4
    off = LengthAwareScheduler(LengthAwareConfig())
    plan = off.plan(6, offers(0, 3))
    assert members(plan) == [("g000", 0), ("g000", 1), ("g000", 2), ("g000", 3), ("g001", 0), ("g001", 1)]


def test_off_starts_members_in_group_order_without_waves() -> None:
    sched = LengthAwareScheduler(LengthAwareConfig())
    plans = [sched.plan(3, offers(0, 3)), sched.plan(3, offers(1, 3)), sched.plan(10, offers(2, 1))]
    assert [m for p in plans for m in members(p)] == [(f"g{g:03d}", m) for g in range(3) for m in range(4)]
    assert [p.admitted for p in plans] == [["g000"], ["g001"], ["g002"]]
    assert {s.wave for p in plans for s in p.starts} == {"plain"}


def test_first_wave_is_the_probe_count_and_siblings_wait_for_a_finisher() -> None:
    sched = LengthAwareScheduler(LengthAwareConfig(enabled=True, probe=2))
    plan = sched.plan(5, offers(0, 4))
    assert members(plan) == [("g000", 0), ("g000", 1), ("g001", 0), ("g001", 1)]  # a third wave won't fit
    assert plan.admitted == ["g000", "g001"]
    assert sched.plan(10, []).starts[0].wave == "fallback"  # nothing left to admit: no point waiting
    sched = LengthAwareScheduler(LengthAwareConfig(enabled=True, probe=2))
    sched.plan(4, offers(0, 2))
    assert members(sched.plan(1, offers(2, 1))) == [] and sched.held() == 4  # 1 < a wave of 2
    sched.end("g001", 1, "finished", 700)
    plan = sched.plan(2, offers(2, 1))
    assert members(plan) == [("g001", 2), ("g001", 3)]
    assert {s.predicted_tokens for s in plan.starts} == {700}


def test_siblings_drain_longest_predicted_first() -> None:
    sched = LengthAwareScheduler(ON)
    probe_and_finish(sched, [100, 900, 400])
    plan = sched.plan(9, offers(3, 5))
    assert members(plan) == [(g, m) for g in ("g001", "g002", "g000") for m in (1, 2, 3)]
    assert [s.predicted_tokens for s in plan.starts] == [900] * 3 + [400] * 3 + [100] * 3
    assert plan.admitted == []


def test_siblings_drain_before_new_groups_probes() -> None:
    sched = LengthAwareScheduler(ON)
    probe_and_finish(sched, [100, 900])
    plan = sched.plan(4, offers(2, 5))
    assert members(plan) == [("g001", 1), ("g001", 2), ("g001", 3), ("g000", 1)] and plan.admitted == []
    plan = sched.plan(4, offers(2, 5))
    assert members(plan) == [("g000", 2), ("g000", 3), ("g002", 0), ("g003", 0)]
    assert [s.wave for s in plan.starts] == ["sibling", "sibling", "probe", "probe"]


def test_a_failed_or_cancelled_probe_still_releases_its_siblings() -> None:
    sched = LengthAwareScheduler(ON)
    sched.plan(3, offers(0, 3))
    sched.end("g000", 0, "failed")
    sched.end("g001", 0, "finished", 5000)
    sched.end("g002", 0, "cancelled")
    plan = sched.plan(9, [])
    # no prediction ranks first (nothing says it is short); then the longest predicted
    assert members(plan) == [(g, m) for g in ("g000", "g002", "g001") for m in (1, 2, 3)]
    assert [s.predicted_tokens for s in plan.starts][:6] == [None] * 6
    done = [sched.end(g, m, "finished", 10) for g, m in members(plan)]
    assert done == [False, False, True] * 3 and sched.state.groups == {}


def test_with_two_probes_one_failing_waits_for_the_other() -> None:
    sched = LengthAwareScheduler(LengthAwareConfig(enabled=True, probe=2))
    sched.plan(2, offers(0, 1))
    sched.end("g000", 0, "cancelled")
    plan = sched.plan(2, offers(1, 5))
    assert members(plan) == [("g001", 0), ("g001", 1)]  # g000 still waits: its other probe runs
    sched.end("g000", 1, "finished", 300)
    plan = sched.plan(2, offers(2, 5))
    assert members(plan) == [("g000", 2), ("g000", 3)] and plan.starts[0].predicted_tokens == 300


def test_max_held_bounds_the_siblings_waiting_behind_probes() -> None:
    assert len(LengthAwareScheduler(ON).plan(5, offers(0, 5)).admitted) == 5
    sched = LengthAwareScheduler(LengthAwareConfig(enabled=True, max_held=6))
    plan = sched.plan(5, offers(0, 5))  # each group of 4 holds 3 behind its probe; a third would hold 9
    assert members(plan) == [("g000", 0), ("g001", 0), ("g000", 1), ("g000", 2), ("g000", 3)]
    assert [s.wave for s in plan.starts] == ["probe", "probe", "fallback", "fallback", "fallback"]
    assert plan.admitted == ["g000", "g001"]


def test_max_and_mean_predictors() -> None:
    for predictor, expected in (("max", 900), ("mean", 500)):
        sched = LengthAwareScheduler(LengthAwareConfig(enabled=True, probe=2, predictor=predictor))
        sched.plan(2, offers(0, 1))
        sched.end("g000", 0, "finished", 100)
        sched.end("g000", 1, "finished", 900)
        assert sched.predicted("g000") == expected
        assert {s.predicted_tokens for s in sched.plan(2, []).starts} == {expected}


def test_progress_releases_early_and_only_in_progress_mode() -> None:
    finish = LengthAwareScheduler(ON)
    finish.plan(1, offers(0, 1))
    finish.progress("g000", 0, 250)
    assert finish.plan(3, []).starts[0].wave == "fallback" and finish.predicted("g000") is None
    early = LengthAwareScheduler(LengthAwareConfig(enabled=True, release="progress"))
    early.plan(2, offers(0, 2))
    early.progress("g000", 0, 250)
    early.progress("g001", 0, 90)
    early.progress("g001", 0, 600)
    plan = early.plan(6, offers(2, 1))
    assert members(plan) == [("g001", 1), ("g001", 2), ("g001", 3), ("g000", 1), ("g000", 2), ("g000", 3)]
    assert [s.predicted_tokens for s in plan.starts] == [600] * 3 + [250] * 3


def test_predicted_long_starts_go_to_the_least_loaded_replica() -> None:
    sched = LengthAwareScheduler(LengthAwareConfig(enabled=True, long_factor=1.5))
    probe_and_finish(sched, [100, 100, 1000])  # mean 400: long from 600 tokens
    plan = sched.plan(6, [], {"r0": 500.0, "r1": 1200.0, "r2": 2000.0})
    assert [(s.group_id, s.replica) for s in plan.starts] == [
        ("g002", "r0"),  # 500 -> 1500
        ("g002", "r1"),  # 1200 -> 2200
        ("g002", "r0"),
        ("g000", None),
        ("g000", None),
        ("g000", None),
    ]
    assert all(s.replica is None for s in sched.plan(3, []).starts)  # no loads given: no hint


def test_ending_twice_or_unstarted_is_refused() -> None:
    sched = LengthAwareScheduler(ON)
    sched.plan(1, offers(0, 1))
    with pytest.raises(ValueError, match="was not started"):
        sched.end("g000", 1, "finished", 5)
    with pytest.raises(ValueError, match="was not started"):
        sched.end("g999", 0, "finished", 5)
    sched.end("g000", 0, "finished", 5)
    with pytest.raises(ValueError, match="already ended"):
        sched.end("g000", 0, "failed")
    with pytest.raises(ValueError, match="offered twice"):
        sched.plan(5, offers(0, 1))
    assert sched.held() == 3  # refused before anything started
    with pytest.raises(ValueError, match="offered twice"):
        sched.plan(5, [offers(1, 1)[0], offers(1, 1)[0]])


def test_the_policy_imports_only_the_standard_library_and_pydantic() -> None:
    tree = ast.parse(Path(bench.length_aware.__file__).read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m.split(".")[0] for m in mods} <= {"__future__", "collections", "typing", "pydantic"}


# --- the workload knob: task-level length correlation in the simulated engine ---------------------------


def _settings(**update: object) -> SimSettings:
    base = SimSettings(
        policy=PolicyName.RANDOM, tasks=None, random_length="heavy_tail", random_median_tokens=100
    )
    return base.model_copy(update=update)


def test_task_scale_makes_siblings_lengths_correlate() -> None:
    flat = _settings(random_length_sigma=0.0, random_tail_fraction=0.0, random_task_sigma=0.5)
    scales = []
    for g in range(400):
        lengths = {heavy_tail_length(f"g{g:05d}/{m}/{t}", flat) for m in range(4) for t in range(3)}
        assert len(lengths) == 1  # one factor for every turn of every member of the task
        scales.append(math.log(lengths.pop() / 100))
    assert abs(statistics.mean(scales)) < 0.08 and 0.42 < statistics.stdev(scales) < 0.58
    noisy = _settings(random_length_sigma=0.5, random_task_sigma=0.5, random_tail_fraction=0.0)
    a = [math.log(heavy_tail_length(f"g{g}/0/0", noisy)) for g in range(2000)]
    b = [math.log(heavy_tail_length(f"g{g}/1/0", noisy)) for g in range(2000)]
    assert 0.4 < statistics.correlation(a, b) < 0.6  # 0.25 / (0.25 + 0.25)
    default = _settings()
    a = [math.log(heavy_tail_length(f"g{g}/0/0", default)) for g in range(2000)]
    b = [math.log(heavy_tail_length(f"g{g}/1/0", default)) for g in range(2000)]
    assert abs(statistics.correlation(a, b)) < 0.08  # the default: independent


def test_task_tail_key_makes_every_rollout_of_a_tail_task_long() -> None:
    per_task = _settings(random_tail_key="task", random_length_sigma=0.0, random_tail_fraction=0.05)
    tasks = [
        {heavy_tail_length(f"run/g{g}/{m}/{t}", per_task) for m in range(8) for t in range(3)}
        for g in range(2000)
    ]
    assert all(t in ({100}, {1000}) for t in tasks)
    assert 70 <= sum(t == {1000} for t in tasks) <= 130
