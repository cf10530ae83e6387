"""The config hash a record's lineage names is the hash of the config as stored with the run, so a later
release (whose config models gained fields with defaults) still finds it."""

from __future__ import annotations

import json

from durable_rollouts.config.load import config_hash
from durable_rollouts.config.models import Config


def test_the_stored_json_hashes_like_the_config_it_was_dumped_from() -> None:
    cfg = Config()
    assert config_hash(json.loads(cfg.model_dump_json())) == config_hash(cfg)


def test_a_stored_config_keeps_its_hash_when_the_models_gain_a_field() -> None:
    stored = json.loads(Config().model_dump_json())
    del stored["run"]["breaker_failures"]  # as a config stored before the field existed
    revalidated = Config.model_validate(stored)  # fills the new field's default
    assert config_hash(stored) != config_hash(revalidated)  # re-validating would change the hash
    assert config_hash(stored) == config_hash(json.loads(json.dumps(stored)))
