"""Helpers of the TRL integration tests: a run config as `section.field=value` overrides, the tiny policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
TASKS = REPO / "environments" / "math" / "math_env" / "data" / "addition.jsonl"
MODEL_DIR = REPO / "engines" / "tiny-policy"


def overrides(engine_url: str, address: str, task_queue: str, **run: Any) -> list[str]:
    out = [
        f"engine.urls={json.dumps([engine_url])}",
        f"temporal.address={json.dumps(address)}",
        f"temporal.task_queue={json.dumps(task_queue)}",
        f"run.task_file={json.dumps(str(TASKS))}",
        "engine.retry_initial_s=0.2",
        "engine.retry_max_s=1.0",
        "sampling.max_tokens=8",
        "sampling.temperature=1.0",
    ]
    return out + [f"run.{k}={json.dumps(v)}" for k, v in run.items()]


def group_advantage(reward: float, group: dict[str, Any], eps: float = 1e-6) -> float:
    """The GRPO advantage the group record's statistics give (workflows/grpo.py)."""
    if group["zero_variance"]:
        return 0.0
    return (reward - group["reward_mean"]) / (group["reward_std"] + eps)
