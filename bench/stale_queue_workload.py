"""The stale-queue workbench's inputs (bench/stale_queue.py runs them): the seeded workload, the simulated
fleet, the trainer, and one run's plan (policy, limit, over-provisioning).

``Workload.group(i)`` is a pure function of the seed and ``i``: every policy sees the same prompts (a shared
system prompt, then the task's) and the same log-normal output lengths, with a tail fraction longer.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """Group ``i`` of the seeded workload: the same prompts and output lengths for every policy."""

    group_size: int = 8
    median_tokens: int = 256
    sigma: float = 0.5
    tail_fraction: float = 0.01
    tail_factor: float = 4.0
    system_tokens: int = 256
    task_tokens: tuple[int, int] = (128, 512)
    max_model_len: int = 4096
    seed: int = 0

    def group(self, i: int) -> tuple[list[int], list[int]]:
        """(prompt token ids, output length of each member)."""
        rng = random.Random(f"{self.seed}:group:{i}")
        system = list(random.Random(f"{self.seed}:system").randbytes(self.system_tokens))
        prompt = system + list(rng.randbytes(rng.randint(*self.task_tokens)))
        room = self.max_model_len - len(prompt)
        lengths = []
        for _ in range(self.group_size):
            n = rng.lognormvariate(math.log(self.median_tokens), self.sigma)
            if rng.random() < self.tail_fraction:
                n *= self.tail_factor
            lengths.append(max(1, min(room, int(n))))
        return prompt, lengths


@dataclass(frozen=True)
class Fleet:
    replicas: int = 2
    kv_blocks: int = 8192
    block_size: int = 16
    max_num_seqs: int = 64


@dataclass(frozen=True)
class Trainer:
    batch_groups: int = 16
    step_s: float = 20.0
    steps: int = 30
    max_lag: int = 1


@dataclass(frozen=True)
class Plan:
    """One run of the workbench: the policy, its limit (``fixed``), the groups over-provisioned on top
    (``extra``) and whether the groups still generating when a batch fills are aborted (``drop``)."""

    policy: str
    limit: int | None = None
    extra: int = 0
    drop: bool = False
