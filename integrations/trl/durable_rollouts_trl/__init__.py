"""durable-rollouts for TRL: feed TRL's GRPO trainers from durable rollouts.

- :class:`~durable_rollouts_trl.worker.DurableRolloutWorker`: ``AsyncGRPOTrainer(rollout_worker=w,
  weight_transfer=w)``.
- :func:`~durable_rollouts_trl.rollout_func.make_rollout_func`: ``GRPOTrainer(rollout_func=f,
  reward_funcs=durable_reward)``.

This package's one import name is unique on purpose: nothing here imports the durable-rollouts core in the
trainer's process (its top-level packages are named ``config``, ``store``, ``trainer``, ... and would
collide with a trainer's own modules); the core runs in a sidecar child (bridge.py, sidecar.py).
Submodules are imported on use, so ``import durable_rollouts_trl`` imports neither TRL nor torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DurableRolloutWorker", "durable_reward", "make_rollout_func"]


def __getattr__(name: str) -> Any:
    if name == "DurableRolloutWorker":
        from durable_rollouts_trl.worker import DurableRolloutWorker

        return DurableRolloutWorker
    if name in ("make_rollout_func", "durable_reward"):
        from durable_rollouts_trl import rollout_func

        return getattr(rollout_func, name)
    raise AttributeError(name)
