"""The sizing arithmetic of bench/sizing.py: cluster sizes from measured CPU per rollout and per extra turn,
with every assumption named (written into the result file beside the sizes)."""

from __future__ import annotations

import math

# The workloads the plan sizes, and what is assumed of them (each one is written into the result file).
ASSUMPTIONS = {
    "math_rate_per_s": 100,
    "agent_concurrent": 1000,
    "agent_turn_s": 10.0,
    "agent_turns": 50,
    "agent_activities_per_turn": 2,
    "gateway_cpu_ms_per_call": 18.6,
    "core_utilisation": 0.6,
    "sandbox_cpus": 1.0,
    "sandbox_memory_gib": 1.0,
    "sandbox_host_cores": 64,
    "sandbox_host_memory_gib": 256,
    "sandbox_cpu_overcommit": 2.0,
    "store_connections_per_worker": 32,
    "shards_per_history_core": 16,
}
NOTES = {
    "agent_turn_s": "one model call plus one tool run per turn, 10 s together (a GPU engine at long context "
    "and a sandbox command); halve it and every agent figure doubles",
    "agent_activities_per_turn": "a measured extra turn of math is one model-call activity; a coding "
    "agent's turn adds a sandbox command, so its worker, server and store cost counts twice",
    "gateway_cpu_ms_per_call": "bench/results/gateway_overhead.json: worker CPU the gateway adds per call "
    "for harness rollouts (mini-swe-agent), on top of the model call's own cost",
    "core_utilisation": "cores are planned at 60 % busy, leaving room for retries, bursts and restarts",
    "sandbox_cpu_overcommit": "agents' sandboxes idle while the model thinks; 2 sandbox CPUs per host core",
    "store_connections_per_worker": "a worker's store calls run on asyncio's default thread pool "
    "(at most 32 threads, one connection each)",
    "shards_per_history_core": "history shards are fixed when the cluster's database is created; a shard "
    "serialises its updates, so plan several per history core and round up to a power of two",
    "server": "the dev server's CPU stands in for a production server's frontend, history and matching "
    "services together; measure the production cluster with this benchmark pointed at it before buying",
}


def plan(measured: dict, a: dict = ASSUMPTIONS) -> dict:
    """Cluster sizes for the two workloads from the CPU per rollout and per extra turn (ms)."""
    one, turn = measured["one_turn_ms"], measured["per_extra_turn_ms"]
    use = a["core_utilisation"]

    def cores(rate_per_s: float, ms: float) -> int:
        return max(1, math.ceil(rate_per_s * ms / 1000 / use))

    def shards(history_cores: int) -> int:
        return 2 ** math.ceil(math.log2(max(1, history_cores) * a["shards_per_history_core"]))

    math_rate = a["math_rate_per_s"]
    math_plan = {part: cores(math_rate, one[part]) for part in ("worker", "server", "postgres")}
    math_plan["worker_processes"] = math_plan["worker"]
    math_plan["store_connections"] = math_plan["worker_processes"] * a["store_connections_per_worker"]
    math_plan["history_shards"] = shards(math_plan["server"])
    math_plan["sandbox_hosts"] = 0

    turns_per_s = a["agent_concurrent"] / a["agent_turn_s"]
    starts_per_s = turns_per_s / a["agent_turns"]
    k = a["agent_activities_per_turn"]
    agent_ms = {p: k * turn[p] + one[p] / a["agent_turns"] for p in ("worker", "server", "postgres")}
    agent_ms["worker"] += a["gateway_cpu_ms_per_call"]
    agent_plan = {part: cores(turns_per_s, agent_ms[part]) for part in agent_ms}
    agent_plan["worker_processes"] = agent_plan["worker"]
    agent_plan["store_connections"] = agent_plan["worker_processes"] * a["store_connections_per_worker"]
    agent_plan["history_shards"] = shards(agent_plan["server"])
    by_cpu = a["sandbox_host_cores"] * a["sandbox_cpu_overcommit"] / a["sandbox_cpus"]
    by_memory = a["sandbox_host_memory_gib"] / a["sandbox_memory_gib"]
    agent_plan["sandbox_hosts"] = math.ceil(a["agent_concurrent"] / min(by_cpu, by_memory))
    agent_plan["turns_per_s"] = round(turns_per_s, 1)
    agent_plan["rollouts_started_per_s"] = round(starts_per_s, 2)
    per_core = {
        p: {
            "one_turn_rollouts_per_s": round(1000 / max(one[p], 0.01), 1),
            "extra_turns_per_s": round(1000 / max(turn[p], 0.01), 1),
        }
        for p in ("worker", "server", "postgres")
    }
    return {"one_core_sustains": per_core, "math_100_per_s": math_plan, "agents_1000_concurrent": agent_plan}
