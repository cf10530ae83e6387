"""The sizing benchmark's arithmetic (bench/sizing_plan.py): cores from CPU per rollout at a planned
utilisation, store connections per worker process, history shards rounded to a power of two, sandbox
hosts bound by the tighter of CPU and memory. The measurement itself (bench/sizing.py) is not run here."""

from __future__ import annotations

from bench.sizing_plan import ASSUMPTIONS, NOTES, plan

MEASURED = {
    "one_turn_ms": {"worker": 60.0, "server": 90.0, "postgres": 6.0},
    "per_extra_turn_ms": {"worker": 20.0, "server": 10.0, "postgres": 1.0},
}


def test_math_cores_are_the_rate_times_cpu_per_rollout_at_the_planned_utilisation() -> None:
    p = plan(MEASURED)["math_100_per_s"]
    # 100/s x 60 ms = 6 cores busy; at 60 % busy that is 10 cores (90 ms: 15; 6 ms: 1)
    assert (p["worker"], p["server"], p["postgres"]) == (10, 15, 1)
    assert p["store_connections"] == 10 * ASSUMPTIONS["store_connections_per_worker"]
    assert p["history_shards"] == 256  # 15 history cores x 16 = 240, rounded up to a power of two
    assert p["sandbox_hosts"] == 0


def test_agent_turns_count_two_activities_the_gateway_and_a_share_of_the_start() -> None:
    p = plan(MEASURED)["agents_1000_concurrent"]
    assert p["turns_per_s"] == 100.0 and p["rollouts_started_per_s"] == 2.0
    # worker per turn: 2 x 20 + 60 / 50 + 18.6 = 59.8 ms; x 100 turns/s / 0.6 = 9.97 -> 10 cores
    assert p["worker"] == 10
    # server: 2 x 10 + 90 / 50 = 21.8 ms -> 3.63 -> 4 cores; 64 shards
    assert (p["server"], p["history_shards"]) == (4, 64)
    # 64 cores x 2 overcommit / 1 CPU = 128 sandboxes a host by CPU, 256 by memory: 1000 / 128 -> 8 hosts
    assert p["sandbox_hosts"] == 8


def test_memory_binds_the_sandbox_hosts_when_it_is_the_tighter_limit() -> None:
    a = {**ASSUMPTIONS, "sandbox_memory_gib": 4.0}  # 256 GiB / 4 = 64 a host, below CPU's 128
    assert plan(MEASURED, a)["agents_1000_concurrent"]["sandbox_hosts"] == 16


def test_one_core_sustains_the_inverse_of_the_cpu_per_rollout_and_per_turn() -> None:
    per_core = plan(MEASURED)["one_core_sustains"]
    assert per_core["worker"] == {"one_turn_rollouts_per_s": 16.7, "extra_turns_per_s": 50.0}
    assert per_core["postgres"]["one_turn_rollouts_per_s"] == 166.7


def test_every_assumption_the_plan_reads_is_explained_or_self_describing() -> None:
    explained = {
        "agent_turn_s", "agent_activities_per_turn", "gateway_cpu_ms_per_call", "core_utilisation",
        "sandbox_cpu_overcommit", "store_connections_per_worker", "shards_per_history_core",
    }  # fmt: skip
    assert explained <= set(NOTES) and explained <= set(ASSUMPTIONS)
