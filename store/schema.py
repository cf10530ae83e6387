"""The store's tables: the base schema and its numbered migrations (SQLite types; see store/db.py).

A migration is never edited once released: a store records the number of the last one it has had, and
a later release only appends. ``SCHEMA_VERSION`` is the newest.
"""

from __future__ import annotations

BASE = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, config_json TEXT NOT NULL, config_hash TEXT NOT NULL,
    created_at REAL NOT NULL, finished_at REAL, status TEXT NOT NULL DEFAULT 'running');
CREATE TABLE IF NOT EXISTS tasks (
    run_id TEXT NOT NULL, idx INTEGER NOT NULL, task_id TEXT NOT NULL, data_json TEXT NOT NULL,
    PRIMARY KEY (run_id, idx));
CREATE INDEX IF NOT EXISTS tasks_by_id ON tasks (run_id, task_id);
CREATE TABLE IF NOT EXISTS segments (
    rollout_id TEXT NOT NULL, name TEXT NOT NULL, kind TEXT NOT NULL, turn INTEGER,
    start INTEGER NOT NULL, length INTEGER NOT NULL, blob TEXT NOT NULL, meta_json TEXT NOT NULL,
    PRIMARY KEY (rollout_id, name));
CREATE TABLE IF NOT EXISTS rollouts (
    rollout_id TEXT PRIMARY KEY, run_id TEXT NOT NULL, group_id TEXT NOT NULL, task_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL, env TEXT NOT NULL, outcome TEXT NOT NULL, reason TEXT,
    reward REAL, scorable INTEGER NOT NULL, advantage REAL, prompt_length INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL, sampling_json TEXT NOT NULL, extra_json TEXT NOT NULL,
    finished_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS rollouts_by_run ON rollouts (run_id, group_id, sample_index);
CREATE TABLE IF NOT EXISTS sandboxes (
    rollout_id TEXT PRIMARY KEY, handle_json TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    run_id TEXT NOT NULL, group_id TEXT NOT NULL, task_id TEXT NOT NULL, record_json TEXT NOT NULL,
    finished_at REAL NOT NULL, PRIMARY KEY (run_id, group_id));
CREATE TABLE IF NOT EXISTS policies (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, version TEXT NOT NULL UNIQUE, weights_hash TEXT NOT NULL,
    weights_dir TEXT NOT NULL, engines_json TEXT NOT NULL, status TEXT NOT NULL, created_at REAL NOT NULL,
    published_at REAL);
CREATE TABLE IF NOT EXISTS dispatch_log (
    run_id TEXT NOT NULL, seq INTEGER NOT NULL, at REAL NOT NULL, record_json TEXT NOT NULL,
    PRIMARY KEY (run_id, seq));
CREATE TABLE IF NOT EXISTS feed (
    run_id TEXT NOT NULL, group_id TEXT NOT NULL, state TEXT NOT NULL, reason TEXT, batch_id TEXT,
    records INTEGER NOT NULL, tokens INTEGER NOT NULL, lag INTEGER, at REAL NOT NULL,
    PRIMARY KEY (run_id, group_id));
"""
"""The tables of release 0.1 (schema version 0)."""

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
CREATE TABLE IF NOT EXISTS manual_actions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, target TEXT NOT NULL, action TEXT NOT NULL,
    reason TEXT, detail_json TEXT NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS manual_actions_by_run ON manual_actions (run_id, seq);
""",
    ),
    (
        2,
        """
ALTER TABLE segments ADD COLUMN tokens BLOB;
ALTER TABLE segments ADD COLUMN logprobs BLOB;
ALTER TABLE segments ADD COLUMN versions TEXT;
""",
    ),
    (
        3,
        """
CREATE TABLE IF NOT EXISTS pool_state (id INTEGER PRIMARY KEY CHECK (id = 1), ready INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS pool_starting (slot INTEGER PRIMARY KEY AUTOINCREMENT, ready_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS pool_holders (key TEXT PRIMARY KEY, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS pool_waiters (key TEXT PRIMARY KEY, at REAL NOT NULL);
""",
    ),
    (
        4,
        """
CREATE TABLE IF NOT EXISTS sandbox_hosts (
    name TEXT PRIMARY KEY, task_queue TEXT NOT NULL, docker_host TEXT NOT NULL, slots INTEGER NOT NULL,
    state TEXT NOT NULL, started_at REAL NOT NULL, heartbeat_at REAL NOT NULL);
ALTER TABLE pool_holders ADD COLUMN host TEXT;
""",
    ),
    (
        5,
        """
CREATE TABLE IF NOT EXISTS image_builds (
    host TEXT NOT NULL, tag TEXT NOT NULL, state TEXT NOT NULL, owner TEXT, builds INTEGER NOT NULL,
    what TEXT, started_at REAL, beat_at REAL, finished_at REAL, log TEXT, error TEXT,
    PRIMARY KEY (host, tag));
""",
    ),
    (
        6,
        """
CREATE TABLE IF NOT EXISTS gateway_calls (
    rollout_id TEXT NOT NULL, idx INTEGER NOT NULL, request_key TEXT NOT NULL, request_json TEXT NOT NULL,
    status INTEGER, response_json TEXT, detail_json TEXT, created_at REAL NOT NULL, answered_at REAL,
    PRIMARY KEY (rollout_id, idx));
""",
    ),
    (
        7,
        """
CREATE TABLE IF NOT EXISTS harness_files (
    rollout_id TEXT NOT NULL, path TEXT NOT NULL, data BLOB, error TEXT, kept_at REAL NOT NULL,
    PRIMARY KEY (rollout_id, path));
""",
    ),
    (
        8,
        """
CREATE TABLE IF NOT EXISTS offpolicy_evidence (
    run_id TEXT NOT NULL, batch_id TEXT NOT NULL, at REAL NOT NULL, record_json TEXT NOT NULL,
    PRIMARY KEY (run_id, batch_id));
""",
    ),
    (
        9,
        """
ALTER TABLE image_builds ADD COLUMN pushed_to TEXT;
ALTER TABLE image_builds ADD COLUMN digest TEXT;
""",
    ),
]
"""(version, DDL) in order. 1: the manual-actions log of ``rollouts cancel/retry/terminate``. 2: token
arrays packed in the segment row (``tokens`` int32, ``logprobs`` float32, little-endian; ``versions`` the
policy version of each token, run-length encoded JSON); rows written before it keep ``tokens`` NULL and
name their JSON file under the store root in ``blob``, and are read from there. 3: the sandbox pool's
state (sandboxes/pool.py), shared by every worker of the store instead of one file per host. 4: sandbox
hosts (sandboxes/hosts.py) and the host each pool slot is held on. 5: image builds per sandbox host
(sandboxes/images.py): one build of a tag per host at a time, its log, and how many builds it took. 6: the
model calls harnesses made through their rollouts' gateways (gateway/): each request, and its answer once
the rollout's model-call activity wrote it. 7: the files a harness leaves in its sandbox that its environment
keeps with the rollout (``HarnessCommand.keep``: e.g. the harness's own trajectory), or why one could not be
read. 8: a trainer's off-policy evidence per consumed batch (its recomputed logprobs against the behaviour
logprobs: |Δ logprob|, KL, importance ratios, tokens by policy lag), shown in the run report. 9: images
from a registry (``sandbox_pool.registry``): the registry-wide build of a tag (its row's ``host`` is
``registry:<registry>``) records the repository it was pushed to and the digest the registry stored, which
every other sandbox host pulls."""

SCHEMA_VERSION = MIGRATIONS[-1][0]
