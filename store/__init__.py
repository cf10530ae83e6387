"""The run store: runs, tasks, token segments, records, dispatch log, policies, feed marks and the sandbox
pool's state, on SQLite (the embedded default) or PostgreSQL, chosen by one URL (`open_store`).

Invariant: every write is idempotent on its key (run id, rollout id and segment name, group id), so a
retried activity finds what an earlier attempt wrote instead of writing it twice.
"""

from durable_rollouts.store.open import open_store, store_exists, store_url
from durable_rollouts.store.runstore import RunStore, Segment, model_segment, obs_segment

__all__ = ["RunStore", "Segment", "model_segment", "obs_segment", "open_store", "store_exists", "store_url"]
