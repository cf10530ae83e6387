"""The closed loop's config: a run config (config/models.py, unchanged) plus a ``[trainer]`` section.

Invariants:
- One TOML file holds both: ``[trainer]`` is validated here (strict, bounded, documented fields) and every
  other section by the project's ``Config``; the run config never learns about the trainer.
- Any problem is a ``ConfigError`` of one line naming the file and the field (``file: section.field: msg``),
  the same contract as :func:`config.load.load_config`; ``--set trainer.lr=...`` overrides work too.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from durable_rollouts.config.load import ConfigError, _one_line, read_toml
from durable_rollouts.config.models import Config


class TrainerSettings(BaseModel):
    """How the example GRPO trainer consumes the feed, optimises, evaluates and publishes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    groups_per_step: int = Field(16, ge=1, le=10_000)
    """Complete, fresh groups per optimiser step (``n_groups`` of ``TrainerFeed.take``)."""
    max_lag: int = Field(1, ge=0, le=1000)
    """Freshness limit: publishes allowed between a token's version and the trainer's current one."""
    drop_zero_variance: bool = True
    """Discard groups whose rewards are all equal (their advantages are 0: no gradient)."""
    max_steps: int = Field(1000, ge=1, le=1_000_000)
    """Most optimiser steps; the loop also ends once the run is done and the feed has nothing fresh left."""
    lr: float = Field(2e-4, gt=0, le=1)
    """AdamW learning rate after warm-up."""
    warmup_steps: int = Field(5, ge=1, le=100_000)
    """Optimiser updates of linear learning-rate warm-up."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay."""
    adam_beta2: float = Field(0.99, gt=0, lt=1)
    """AdamW beta2 (beta1 is 0.9)."""
    epochs: int = Field(1, ge=1, le=100)
    """Passes over each batch (PPO-style reuse; the clip range bounds how far the passes move the policy)."""
    minibatches: int = Field(1, ge=1, le=1000)
    """Optimiser updates per pass (the batch's rollouts shuffled and split)."""
    clip_low: float = Field(0.2, ge=0, lt=1)
    """Importance ratios below 1 - clip_low are clipped."""
    clip_high: float = Field(0.2, ge=0, le=10)
    """Importance ratios above 1 + clip_high are clipped."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient norm clip per update."""
    seed: int = Field(0, ge=0)
    """Seed of torch (mini-batch shuffles)."""
    threads: int = Field(1, ge=1, le=256)
    """torch CPU threads (leave the other cores to the engine and Temporal)."""
    poll_s: float = Field(0.5, gt=0, le=60)
    """How often to ask the feed again while waiting for groups."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """Fail when no group completes for this long while the run is still going."""
    eval_task_file: str = Field("math_env:data/addition.jsonl", min_length=1)
    """Fixed evaluation set (math JSONL; relative paths resolve against the repository)."""
    eval_samples_per_task: int = Field(4, ge=0, le=1000)
    """Answers sampled per evaluation task at the start and at the end (0 skips the evaluations)."""
    eval_seed: int = Field(12345, ge=0)
    """Base seed of the evaluation's per-sample seeds (the same at start and end)."""
    eval_concurrency: int = Field(32, ge=1, le=4096)
    """Evaluation requests in flight at once."""
    weights_root: str | None = None
    """Where version directories are written; None = ``$ROLLOUTS_HOME/policies``."""

    @model_validator(mode="after")
    def _check(self) -> TrainerSettings:
        if self.minibatches > 1 and self.groups_per_step * 2 < self.minibatches:
            raise ValueError("minibatches exceeds what groups_per_step can fill")
        return self


def load_loop_config(
    path: str | Path | None, overrides: list[str] | None = None
) -> tuple[Config, TrainerSettings]:
    """Read a loop config (run sections + ``[trainer]``), apply ``section.field=value`` overrides, validate.

    Raises:
        ConfigError: One line naming the file (or override) and the field.
    """
    data, source = read_toml(path, overrides)
    table = data.pop("trainer", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: trainer: must be a table")
    try:
        trainer = TrainerSettings.model_validate(table)
    except ValidationError as e:
        raise ConfigError(_one_line(source, e).replace(f"{source}: ", f"{source}: trainer.", 1)) from e
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_one_line(source, e)) from e
    return cfg, trainer
