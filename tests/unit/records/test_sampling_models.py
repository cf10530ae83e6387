"""The sampling settings have three models, one per boundary they cross (docs/development.md, "One model per
boundary"): the run config a user writes (``SamplingConfig``: bounds, ``extra="forbid"``), the workflow
payload Temporal records (``SamplingParams``: its shape is fixed by the histories of released versions), and
the exported record (``SamplingRecord``: defaults for fields older records lack, the committed JSON Schema).
They must carry the same settings: a setting added to one and not the others would be lost on its way from
the config to the record."""

from __future__ import annotations

from durable_rollouts.config.models import SamplingConfig
from durable_rollouts.contracts.types import SamplingParams
from durable_rollouts.records.record import SamplingRecord


def test_the_config_payload_and_record_models_carry_the_same_sampling_settings() -> None:
    declared = set(SamplingConfig.model_fields) | {"logprob_mode"}  # the mode comes from [engine]
    assert set(SamplingParams.model_fields) == declared
    assert set(SamplingRecord.model_fields) == declared


def test_a_run_config_s_sampling_reaches_the_record_unchanged() -> None:
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, max_tokens=64, min_tokens=2, seed=5)
    params = SamplingParams(**cfg.model_dump(), logprob_mode="processed_logprobs")
    record = SamplingRecord.model_validate(params.model_dump())
    assert record.model_dump() == params.model_dump()
