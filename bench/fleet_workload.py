"""The seeded multi-turn workload the simulated-fleet benches play (`admission_fleet.py`,
`admission_family.py`): rollout ``i`` is the same for every policy. Groups of ``group_size`` share a task
prompt behind a system prompt shared by all; each rollout has ``min_turns``..``max_turns`` turns, each
followed by a 64-384 token tool result and a log-normal tool wait (median ``tool_median_s``, at most 60 s)."""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Rollout:
    rid: str
    prompt: list[int]
    turns: list[tuple[list[int], float]]
    """Per turn: the tool result appended after it, and the simulated seconds the tool takes."""
    seed: int


class Workload:
    """Rollout ``i`` of the seeded workload, the same for every policy."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        rng = random.Random(f"{args.seed}:system")
        self.system = [rng.randrange(256) for _ in range(256)]

    def rollout(self, i: int) -> Rollout:
        a = self.args
        g, m = divmod(i, a.group_size)
        task_rng = random.Random(f"{a.seed}:task:{g}")
        task = [task_rng.randrange(256) for _ in range(task_rng.randint(256, 768))]
        rng = random.Random(f"{a.seed}:rollout:{i}")
        turns = []
        for _ in range(rng.randint(a.min_turns, a.max_turns)):
            tool = [rng.randrange(256) for _ in range(rng.randint(64, 384))]
            turns.append((tool, min(60.0, rng.lognormvariate(math.log(a.tool_median_s), 0.8))))
        return Rollout(f"g{g:05d}/{m}", self.system + task, turns, seed=rng.randrange(2**31))
