"""The run store: runs, tasks, token segments, records, dispatch log, policies and feed marks.

Invariant: every write is idempotent on its key (run id, rollout id and segment name, group id), so a
retried activity finds what an earlier attempt wrote instead of writing it twice.
"""

from store.runstore import RunStore, Segment, model_segment, obs_segment

__all__ = ["RunStore", "Segment", "model_segment", "obs_segment"]
