"""``group.batch_rollouts``: off by default, refused in one line with the settings it excludes, and set in
the rollouts' template only for environments whose steps run inline without a sandbox or a harness."""

from __future__ import annotations

from pathlib import Path

import pytest

from durable_rollouts.config.load import ConfigError, load_config
from durable_rollouts.contracts.types import EnvTraits
from durable_rollouts.workflows.group import rollout_template


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "extra",
    [
        "[rollout]\nlocal_model_calls = true\n[group]\nbatch_rollouts = true\ninline_rollouts = true\n",
        "[rollout]\nstep_token_budget = 64\n[group]\nbatch_rollouts = true\n",
    ],
)
def test_batches_refuse_inline_members_and_partial_rollouts_in_one_line(tmp_path: Path, extra: str) -> None:
    path = _write(tmp_path, extra)
    with pytest.raises(ConfigError, match=r"group\.batch_rollouts excludes group\.inline_rollouts") as e:
        load_config(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_batches_apply_to_inline_environments_without_a_sandbox_or_a_harness(tmp_path: Path) -> None:
    assert not load_config(None).group.batch_rollouts  # off by default
    cfg = load_config(_write(tmp_path, "[group]\nbatch_rollouts = true\n"))
    math = EnvTraits(name="math", uses_sandbox=False, inline_steps=True, harness=False)
    coding = EnvTraits(name="coding", uses_sandbox=True, inline_steps=False, harness=False)
    harness = EnvTraits(name="h", uses_sandbox=True, inline_steps=False, harness=True)
    assert rollout_template(cfg, "r", math).batched
    assert not rollout_template(cfg, "r", coding).batched
    assert not rollout_template(cfg, "r", harness).batched
    assert not rollout_template(load_config(None), "r", math).batched
