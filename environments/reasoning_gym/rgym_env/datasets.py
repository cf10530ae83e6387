"""reasoning-gym datasets, re-created from (name, seed, size, config) and kept per process.

A dataset is a pure function of those four: the same arguments give the same entries and the same
``score_answer`` on any host, which is why a task stores them instead of a reference to a live object.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any


def dataset(name: str, seed: int, size: int, config: dict[str, Any]) -> Any:
    """The dataset ``reasoning_gym.create_dataset(name, seed=seed, size=size, **config)`` (cached).

    Raises:
        Exception: whatever reasoning-gym raises for an unknown name or a config it rejects.
    """
    return _cached(name, seed, size, json.dumps(config, sort_keys=True))


@lru_cache(maxsize=64)
def _cached(name: str, seed: int, size: int, config_json: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))
