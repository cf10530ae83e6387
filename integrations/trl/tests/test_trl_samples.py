"""Records as TRL inputs (samples.py) and the off-policy evidence (offpolicy.py), without services.

The evidence is checked on the bundled tiny policy: records whose behaviour logprobs the same weights
produced at the same temperature give Δ = 0 and no flag; scoring them at another temperature, or with other
weights, is flagged.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from durable_rollouts_trl.offpolicy import evidence, metrics, recompute
from durable_rollouts_trl.samples import (
    SampleError,
    Sampling,
    check_sampling,
    group_index,
    rollout_func_row,
    sample_fields,
)
from durable_rollouts_trl.weights import WeightsError, save_weights
from trl_support import MODEL_DIR


def _rec(**kw: Any) -> dict[str, Any]:
    base = {
        "rollout_id": "r/g000003/1", "group_id": "g000003", "reward": 1.0, "advantage": 0.5, "scorable": True,
        "token_ids": [257, 5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 0, 1],
        "logprobs": [None, None, -0.5, -1.0, None, -2.0],
        "policy_versions": [None, None, "v1", "v2", None, "v2"],
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprob_mode": "processed_logprobs"},
    }  # fmt: skip
    return {**base, **kw}


def test_sample_fields_follow_the_record() -> None:
    order = {"v0": 0, "v1": 1, "v2": 2}
    f = sample_fields(_rec(), order, "v2", 7, Sampling())
    assert f is not None
    assert f["input_ids"] == [257, 5, 6, 7, 8, 9]
    assert f["completion_mask"] == [0, 0, 1, 1, 0, 1]  # the observation token (index 4) is not trained
    assert f["old_log_probs"] == [0.0, 0.0, -0.5, -1.0, 0.0, -2.0]
    assert f["advantage"] == 0.5 and f["group_id"] == 3
    assert f["model_version"] == 6  # the oldest sampled token is v1, one publish behind v2 (TRL version 7)
    assert sample_fields(_rec(advantage=None), order, "v2", 7, Sampling()) is None  # not scorable: no sample


def test_records_whose_logprobs_mean_something_else_are_refused() -> None:
    with pytest.raises(SampleError, match=r"temperature 1\.0 but the trainer's temperature is 0\.7"):
        check_sampling(_rec(), Sampling(temperature=0.7))
    raw = _rec(sampling={**_rec()["sampling"], "logprob_mode": "raw_logprobs"})
    with pytest.raises(SampleError, match="logprob_mode 'raw_logprobs'"):
        check_sampling(raw, Sampling())
    with pytest.raises(SampleError, match="top_p/top_k"):
        check_sampling(_rec(sampling={**_rec()["sampling"], "top_p": 0.9}), Sampling())
    with pytest.raises(SampleError, match="not a g<index>"):
        group_index("grp-3")


def test_rollout_func_row_masks_observations() -> None:
    row = rollout_func_row(_rec())
    assert row["prompt_ids"] == [257, 5] and row["completion_ids"] == [6, 7, 8, 9]
    assert row["logprobs"] == [-0.5, -1.0, 0.0, -2.0] and row["env_mask"] == [1, 1, 0, 1]


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)


def _sampled_records(model: torch.nn.Module, temperature: float) -> list[dict[str, Any]]:
    """Records whose sampled tokens' logprobs ``model`` gives at ``temperature`` (a stand-in engine)."""
    g = torch.Generator().manual_seed(0)
    recs = []
    for k in range(4):
        ids = [257, 20 + k, 30 + k, 40 + k]
        mask = [0, 0, 0, 0]
        with torch.no_grad():
            for _ in range(6):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1] / temperature
                ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)))
                mask.append(1)
        ids.append(99)  # an observation token
        mask.append(0)
        lp = recompute(model, [{"token_ids": ids}], temperature)[0]
        recs.append({"rollout_id": f"r{k}", "token_ids": ids, "loss_mask": mask,
                     "logprobs": [x if m else None for x, m in zip(lp, mask, strict=True)]})  # fmt: skip
    return recs


def test_evidence_is_zero_at_equal_weights_and_flags_a_temperature_mismatch() -> None:
    model = _model()
    recs = _sampled_records(model, 1.0)
    lags = [[0] * sum(r["loss_mask"]) for r in recs]
    same = evidence(model, recs, 1.0, lags)
    assert same["tokens"] == 24 and not same["flagged"]
    assert same["max_abs_dlogp"] < 1e-5 and same["ratio_p50"] == pytest.approx(1.0, abs=1e-5)
    assert abs(same["kl_k3"]) < 1e-8 and same["lag_share"] == {"0": 1.0}
    wrong = evidence(model, recs, 0.5, lags)  # the trainer scores at another temperature than sampled
    assert wrong["flagged"] and "temperature" in wrong["flag"]
    assert wrong["mean_abs_dlogp"] > 0.05
    assert metrics(wrong)["offpolicy/flagged"] == 1.0 and metrics(same)["offpolicy/lag_share/0"] == 1.0


def test_evidence_of_lagged_tokens_is_reported_not_flagged() -> None:
    model = _model()
    recs = _sampled_records(model, 1.0)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    lags = [[1] * sum(r["loss_mask"]) for r in recs]  # sampled one publish ago
    ev = evidence(moved, recs, 1.0, lags)
    assert not ev["flagged"] and ev["lag0_tokens"] == 0 and ev["lag_share"] == {"1": 1.0}
    assert ev["mean_abs_dlogp"] > 1e-3 and ev["ratio_max"] >= ev["ratio_p99"] >= ev["ratio_p50"]
    same_lag0 = evidence(moved, recs, 1.0, [[0] * len(x) for x in lags])  # other weights claimed as equal
    assert same_lag0["flagged"]


def test_weights_are_written_complete_or_not_at_all(tmp_path: Any) -> None:
    model = _model()
    out = save_weights(model.state_dict().items(), MODEL_DIR, tmp_path / "v1")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    partial = [(k, v) for k, v in model.state_dict().items() if "lm_head" not in k]
    with pytest.raises(WeightsError, match=r"no tensor lm_head\.weight"):
        save_weights(partial, MODEL_DIR, tmp_path / "v2")
    assert not (tmp_path / "v2").exists()
    cut = [(k, v[:1] if k == "lm_head.weight" else v) for k, v in model.state_dict().items()]
    with pytest.raises(WeightsError, match=r"tensor lm_head\.weight: shape \[1, "):
        save_weights(cut, MODEL_DIR, tmp_path / "v3")
    assert not (tmp_path / "v3").exists()
    with pytest.raises(WeightsError, match="already exists"):
        save_weights(model.state_dict().items(), MODEL_DIR, tmp_path / "v1")
