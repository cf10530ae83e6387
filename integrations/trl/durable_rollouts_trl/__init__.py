"""durable-rollouts for TRL: feed TRL's GRPO trainers from durable rollouts.

- :class:`~durable_rollouts_trl.worker.DurableRolloutWorker`: ``AsyncGRPOTrainer(rollout_worker=w,
  weight_transfer=w)``.
- :func:`~durable_rollouts_trl.rollout_func.make_rollout_func`: ``GRPOTrainer(rollout_func=f,
  reward_funcs=durable_reward)``.

The durable-rollouts core runs in the trainer's own process: it installs under one import namespace,
``durable_rollouts.*``, so it never collides with a trainer's own ``config.py``, ``store.py`` or
``trainer.py``; :class:`~durable_rollouts_trl.core.Core` is this package's one handle on it (core.py).
Submodules are imported on use, so ``import durable_rollouts_trl`` imports neither TRL, torch nor the core.
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
