"""The project's Prometheus metrics: every metric defined once, here, and the few functions that record them.

Processes serve them with :func:`metrics.serve.serve_metrics` (workers on ``--metrics-port``; the README's
"Metrics" section lists them with the scrape config). The facts are recorded where they are known:

- ``finalize_rollout`` (activities/rollout.py) calls :func:`record_rollout` with the record it wrote and the
  segments it had already read: records by env/outcome/reason, the per-turn time histograms, sampled tokens
  and sandbox slot waits.
- ``poll_fleet`` (activities/dispatch.py) calls :func:`record_poll` with the dispatcher's previous decision
  and what it just read: the admission cap, KV usage, running, waiting and preemptions per engine, the
  sandbox pool, the trainer feed's waiting groups.
- ``TrainerFeed.take`` (trainer/feed.py) calls :func:`record_feed` with the groups it consumed and
  discarded: lag (freshness), discards by reason, records and tokens consumed.
- The worker's :class:`metrics.serve.ActivitiesInFlight` interceptor keeps ``rollouts_inflight``.

Invariants:
- Counted once: :func:`record_rollout` is called only when ``store.put_rollout`` inserted the record (its
  first write), so a retried finalize never counts a rollout or its turns twice; :func:`record_feed` only
  with the marks this feed won. Counters are per process: sum them over processes (``sum(...)``).
- Bounded labels: env, outcome, the reason's kind (:func:`reason_label` drops free text), engine URL,
  run id, activity name. Never a rollout, group or task id.
- Cheap: recording is counter increments and histogram observes on data already in hand; nothing here
  reads the store or does I/O.
- Gauges set from a poll (``rollouts_admission_*``, ``rollouts_engine_*``, ``rollouts_sandbox_*``,
  ``rollouts_feed_waiting_groups``) belong to the worker that ran the run's last poll;
  ``rollouts_poll_timestamp_seconds`` says when, so a query across workers takes the freshest
  (``max``, or filter on the timestamp).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from durable_rollouts.contracts.types import DispatchLog, FleetPoll

TURN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
"""Seconds; per-turn times run from a millisecond (an instant env step) to minutes (a long generation)."""

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
"""Publishes between a consumed group's oldest sampling version and the trainer's current one."""

# -- rollouts (recorded by finalize_rollout, once per record) -----------------------------------------------
RECORDS = Counter(
    "rollouts_records",
    "Rollout records written, by environment, outcome and the reason's kind (see reason_label).",
    ["env", "outcome", "reason"],
)
TURNS = Counter("rollouts_turns", "Model turns of written rollout records.", ["env"])
TURN_QUEUE = Histogram(
    "rollouts_turn_queue_seconds",
    "Per turn: waiting before the model call ran (task queue + engine queue).",
    ["env"],
    buckets=TURN_BUCKETS,
)
TURN_MODEL = Histogram(
    "rollouts_turn_model_seconds", "Per turn: the engine's prefill and decode.", ["env"], buckets=TURN_BUCKETS
)
TURN_ENV = Histogram(
    "rollouts_turn_env_seconds",
    "Per turn with an environment step: parsing, acting, observing.",
    ["env"],
    buckets=TURN_BUCKETS,
)
TURN_REWARD = Histogram(
    "rollouts_turn_reward_seconds", "Per scored turn: computing the reward.", ["env"], buckets=TURN_BUCKETS
)
TOKENS_GENERATED = Counter(
    "rollouts_tokens_generated", "Sampled tokens (loss mask 1) of written rollout records.", ["env"]
)
SLOT_WAITS = Counter(
    "rollouts_sandbox_slot_waits", "Waits for a free sandbox slot, of written rollout records.", ["env"]
)

# -- in flight (the worker's activity interceptor) ----------------------------------------------------------
INFLIGHT = Gauge(
    "rollouts_inflight",
    "Activities executing now on this worker, by phase (generate, env, prepare, sandbox, record, dispatch, "
    "run) and activity; summed over workers, the rollouts in each phase.",
    ["phase", "activity"],
)

# -- the dispatcher (recorded by poll_fleet) ----------------------------------------------------------------
POLL_TIME = Gauge("rollouts_poll_timestamp_seconds", "When this worker last polled the run's fleet.", ["run"])
ADMISSION_CAP = Gauge("rollouts_admission_cap", "The dispatcher's cap in rollouts (last decision).", ["run"])
ADMISSION_INFLIGHT = Gauge(
    "rollouts_admission_inflight",
    "Rollouts in flight as the dispatcher counted them (last decision).",
    ["run"],
)
ADMISSION_CANCELS = Gauge(
    "rollouts_admission_cancelled", "Rollouts the last decision cancelled for admission.", ["run"]
)
ADMISSION_KV_CAP = Gauge(
    "rollouts_admission_kv_cap",
    "The cap the engine rules alone chose at the last decision (above the cap when rule O held it).",
    ["run"],
)
WORKFLOW_TASK_WAIT = Gauge(
    "rollouts_workflow_task_wait_seconds",
    "How long the run's workflow tasks wait for a worker slot (rule O's signal, as last polled).",
    ["run", "source"],
)
ENGINE_KV = Gauge("rollouts_engine_kv_usage", "KV-cache usage (0-1) an engine reported.", ["engine"])
ENGINE_RUNNING = Gauge("rollouts_engine_running", "Requests running on an engine.", ["engine"])
ENGINE_WAITING = Gauge("rollouts_engine_waiting", "Requests waiting for capacity on an engine.", ["engine"])
ENGINE_PREEMPTIONS = Gauge(
    "rollouts_engine_preemptions", "An engine's preemption counter as last read (monotonic).", ["engine"]
)
ENGINE_KV_CAPACITY = Gauge(
    "rollouts_engine_kv_capacity_tokens", "An engine's KV capacity in tokens.", ["engine"]
)
ENGINE_POLL_ERRORS = Counter(
    "rollouts_engine_poll_errors", "Polls of an engine's /metrics that gave no reading.", ["engine"]
)
SANDBOX_SLOTS = Gauge(
    "rollouts_sandbox_slots", "The sandbox pool: ready, starting, in_use, waiting, limit.", ["state"]
)
FEED_WAITING = Gauge(
    "rollouts_feed_waiting_groups",
    "Complete groups the trainer feed has not taken (max_queued_groups).",
    ["run"],
)

# -- the trainer feed (recorded by TrainerFeed.take, in the trainer's process) ------------------------------
FEED_GROUPS = Counter(
    "rollouts_feed_groups",
    "Groups the trainer feed took, by state and the discard reason's kind.",
    ["state", "reason"],
)
FEED_RECORDS = Counter("rollouts_feed_records", "Rollout records the feed consumed or discarded.", ["state"])
FEED_TOKENS = Counter("rollouts_feed_tokens", "Sampled tokens the feed consumed or discarded.", ["state"])
FEED_LAG = Histogram(
    "rollouts_feed_lag",
    "Freshness of consumed groups: publishes behind the current version.",
    buckets=LAG_BUCKETS,
)

PHASES = {
    "generate_turn": "generate",
    "env_step": "env",
    "prepare_rollout": "prepare",
    "sandbox_create": "sandbox",
    "sandbox_recover": "sandbox",
    "sandbox_destroy": "sandbox",
    "finalize_rollout": "record",
    "finalize_group": "record",
    "poll_fleet": "dispatch",
}
"""Activity name -> phase of ``rollouts_inflight``; any other activity is phase ``run``."""


def reason_label(reason: str | None) -> str:
    """The bounded kind of a record's reason, a label: ``infra: EngineUnreachable: ...`` ->
    ``infra: EngineUnreachable``, ``environment: ...`` -> ``environment``, ``max_turns`` -> ``max_turns``,
    ``stale: lag 3 > max_lag 2`` -> ``stale``, None -> ``""``."""
    if not reason:
        return ""
    parts = [p.strip() for p in reason.split(":")]
    kind = ": ".join(parts[:2]) if parts[0] == "infra" and len(parts) > 1 else parts[0]
    return kind[:64]


def phase_of(activity: str) -> str:
    return PHASES.get(activity, "run")


def record_rollout(
    env: str, outcome: str, reason: str | None, segments: Iterable[Any], slot_waits: int = 0
) -> None:
    """Count one rollout record at its first write: the record, and every model turn's times from its
    segment meta (``queue_s``, ``model_s``, ``env_s``, ``reward_s``; a time missing from a turn's meta is
    not observed). ``segments``: the rollout's ``store.Segment``s, as finalize read them."""
    RECORDS.labels(env, outcome, reason_label(reason)).inc()
    turns = tokens = 0
    queue, model, env_t, reward = (h.labels(env) for h in (TURN_QUEUE, TURN_MODEL, TURN_ENV, TURN_REWARD))
    for seg in segments:
        if seg.kind != "model":
            continue
        turns += 1
        tokens += len(seg.token_ids)
        meta = seg.meta
        for hist, key in ((queue, "queue_s"), (model, "model_s"), (env_t, "env_s"), (reward, "reward_s")):
            value = meta.get(key)
            if isinstance(value, int | float):
                hist.observe(max(0.0, float(value)))
    if turns:
        TURNS.labels(env).inc(turns)
    if tokens:
        TOKENS_GENERATED.labels(env).inc(tokens)
    if slot_waits:
        SLOT_WAITS.labels(env).inc(slot_waits)


def record_poll(
    run_id: str, log: DispatchLog | None, poll: FleetPoll, engine_urls: Sequence[str], feed_counted: bool
) -> None:
    """Set the dispatcher's gauges from one poll: its previous decision (``log``) and what it read
    (``feed_counted``: the poll counted the feed's waiting groups)."""
    POLL_TIME.labels(run_id).set(poll.at)
    if log is not None:
        ADMISSION_CAP.labels(run_id).set(log.cap)
        ADMISSION_INFLIGHT.labels(run_id).set(log.inflight)
        ADMISSION_CANCELS.labels(run_id).set(log.cancelled)
        if log.kv_cap is not None:
            ADMISSION_KV_CAP.labels(run_id).set(log.kv_cap)
    b = poll.backlog
    if b is not None:
        if b.reported:
            WORKFLOW_TASK_WAIT.labels(run_id, "queue").set(b.age_s)
        if b.latency_s is not None:
            WORKFLOW_TASK_WAIT.labels(run_id, "own").set(b.latency_s)
    read: set[str] = set()
    for r in poll.readings:
        read.add(r.engine_id)
        ENGINE_KV.labels(r.engine_id).set(r.kv_usage)
        ENGINE_RUNNING.labels(r.engine_id).set(r.running)
        ENGINE_WAITING.labels(r.engine_id).set(r.waiting_capacity)
        ENGINE_PREEMPTIONS.labels(r.engine_id).set(r.preemptions_total)
        ENGINE_KV_CAPACITY.labels(r.engine_id).set(r.kv_capacity_tokens)
    for url in engine_urls:
        if url not in read:
            ENGINE_POLL_ERRORS.labels(url).inc()
    if poll.pool is not None:
        p = poll.pool
        for state, n in (
            ("ready", p.ready),
            ("starting", p.starting),
            ("in_use", p.in_use),
            ("waiting", p.waiting),
            ("limit", p.max_size),
        ):
            SANDBOX_SLOTS.labels(state).set(n)
    if feed_counted:
        FEED_WAITING.labels(run_id).set(poll.unconsumed_groups)


def record_feed(consumed: Iterable[tuple[int, int, int]], discarded: Iterable[tuple[str, int, int]]) -> None:
    """Count what one feed take won: consumed groups as (lag, records, tokens), discarded ones as
    (reason, records, tokens)."""
    for lag, records, tokens in consumed:
        FEED_GROUPS.labels("consumed", "").inc()
        FEED_RECORDS.labels("consumed").inc(records)
        FEED_TOKENS.labels("consumed").inc(tokens)
        FEED_LAG.observe(lag)
    for reason, records, tokens in discarded:
        FEED_GROUPS.labels("discarded", reason_label(reason)).inc()
        FEED_RECORDS.labels("discarded").inc(records)
        FEED_TOKENS.labels("discarded").inc(tokens)
