"""The example GRPO trainer: loss, record-to-tensor conversion, one optimiser step, checkpoints, loop config,
and the stack recording the bundled policy as the first published version.

The loss tests use hand-made logprob tensors (exact expectations); the step and checkpoint tests use the
bundled tiny policy (0.5 M parameters, milliseconds per step).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from durable_rollouts.config.load import ConfigError
from durable_rollouts.engines.policy import weights_hash
from durable_rollouts.store.runstore import RunStore
from durable_rollouts.trainer.batch import BatchError, to_tensors
from durable_rollouts.trainer.feed import TrainerFeed
from durable_rollouts.trainer.loop import Optimiser, next_version, train_step
from durable_rollouts.trainer.loss import clipped_policy_loss, token_logprobs
from durable_rollouts.trainer.policy_io import PolicyIOError, load_policy, save_policy
from durable_rollouts.trainer.settings import TrainerSettings, load_loop_config
from tests import REPO_ROOT

MODEL = REPO_ROOT / "engines" / "tiny-policy"
EXAMPLE = REPO_ROOT / "config" / "examples" / "grpo_loop.toml"


def _loss_and_grad(cur: list[list[float]], old: list[list[float]], adv: list[float], mask: list[list[int]]):
    logp = torch.tensor(cur, requires_grad=True)
    loss, stats = clipped_policy_loss(logp, torch.tensor(old), torch.tensor(adv), torch.tensor(mask))
    loss.backward()
    assert logp.grad is not None
    return loss, stats, logp.grad


# -- the loss ---------------------------------------------------------------------------------------------


def test_ratio_is_one_when_current_and_recorded_logprobs_match() -> None:
    lp = [[-0.5, -1.0, -2.0], [-0.1, -0.2, -3.0]]
    loss, stats, grad = _loss_and_grad(lp, lp, [1.5, -0.5], [[1, 1, 1], [1, 1, 0]])
    assert stats.mean_ratio == pytest.approx(1.0)
    assert stats.clip_fraction == 0.0 and stats.approx_kl == pytest.approx(0.0)
    # r = 1: loss = -mean(A) over the 5 masked tokens, d loss / d logp = -A / 5 (d r / d logp = r = 1).
    assert loss.item() == pytest.approx(-(3 * 1.5 + 2 * -0.5) / 5)
    assert torch.allclose(grad, torch.tensor([[-0.3, -0.3, -0.3], [0.1, 0.1, 0.0]]))


@pytest.mark.parametrize(
    ("log_ratio", "adv", "flows"),
    [
        (math.log(1.5), 1.0, False),  # above 1 + eps, pushed up further: clipped, no gradient
        (math.log(0.5), -1.0, False),  # below 1 - eps, pushed down further: clipped, no gradient
        (math.log(0.5), 1.0, True),  # below the range but the advantage pulls it back: gradient flows
        (math.log(1.5), -1.0, True),  # above the range, negative advantage pulls it back: gradient flows
        (math.log(1.1), 1.0, True),  # inside the range: gradient flows
    ],
)
def test_clipping_stops_the_gradient_only_beyond_the_range_in_the_advantage_direction(
    log_ratio: float, adv: float, flows: bool
) -> None:
    loss, stats, grad = _loss_and_grad([[-1.0 + log_ratio]], [[-1.0]], [adv], [[1]])
    if flows:
        assert grad[0, 0].item() == pytest.approx(-adv * math.exp(log_ratio))
    else:
        assert grad[0, 0].item() == 0.0
        assert loss.item() == pytest.approx(-adv * (1.2 if log_ratio > 0 else 0.8))
    assert stats.clip_fraction == (0.0 if abs(log_ratio) < math.log(1.2) else 1.0)


def test_zero_advantage_gives_zero_loss_and_zero_gradient_through_the_model() -> None:
    model = load_policy(MODEL)
    ids = torch.tensor([[260, 49, 50, 43, 51, 48, 61, 258, 261, 52, 50, 258]])
    logp = token_logprobs(model(input_ids=ids).logits, ids)
    mask = torch.zeros_like(logp)
    mask[0, 8:] = 1
    loss, _ = clipped_policy_loss(logp, logp.detach() - 0.3, torch.tensor([0.0]), mask)
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_masked_tokens_contribute_nothing_even_with_garbage_recorded_logprobs() -> None:
    cur = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 0]])
    adv = torch.tensor([2.0])
    clean, _ = clipped_policy_loss(cur, torch.tensor([[0.0, -1.0, 0.0]]), adv, mask)
    garbage, _ = clipped_policy_loss(cur, torch.tensor([[float("nan"), -1.0, float("-inf")]]), adv, mask)
    garbage.backward()
    assert garbage.item() == pytest.approx(clean.item()) == pytest.approx(-2.0)
    assert cur.grad is not None
    assert cur.grad[0, 0].item() == 0.0 and cur.grad[0, 2].item() == 0.0 and cur.grad[0, 1].item() != 0.0


def test_no_masked_token_gives_a_zero_loss_not_nan() -> None:
    loss, stats, grad = _loss_and_grad([[-1.0]], [[-1.0]], [1.0], [[0]])
    assert loss.item() == 0.0 and stats.tokens == 0 and torch.count_nonzero(grad) == 0


def test_token_logprobs_score_the_next_recorded_token_at_the_sampling_temperature() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, generator=gen)
    ids = torch.randint(0, 7, (2, 4), generator=gen)
    for temp in (1.0, 0.7):
        got = token_logprobs(logits, ids, temp)
        want = torch.log_softmax(logits[1, 2] / temp, -1)[ids[1, 3]]
        assert got.shape == (2, 3) and got[1, 2].item() == pytest.approx(want.item(), abs=1e-6)


# -- records to tensors -----------------------------------------------------------------------------------


def _record(rid: str, prompt: list[int], sampled: list[int], lps: list[float], adv: float | None, **kw):
    n = len(prompt)
    return {
        "kind": "rollout",
        "rollout_id": rid,
        "token_ids": prompt + sampled,
        "loss_mask": [0] * n + [1] * len(sampled),
        "logprobs": [None] * n + lps,
        "policy_versions": [None] * n + ["v0"] * len(sampled),
        "advantage": adv,
        "reward": 1.0,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, **kw},
    }


def test_records_become_shifted_tensors_of_the_recorded_ids_without_unscorable_members() -> None:
    recs = [
        _record("a", [260, 49, 258, 261], [52, 258], [-0.1, -0.2], 1.0),
        _record("b", [260, 49, 50, 258, 261], [53, 54, 258], [-0.3, -0.4, -0.5], -1.0),
        _record("c", [260, 258, 261], [55], [-9.0], None),  # failed member: no advantage
    ]
    tb = to_tensors(recs, pad_id=256)
    assert tb is not None and tb.rollout_ids == ["a", "b"]
    assert tb.token_ids[0].tolist() == [260, 49, 258, 261, 52, 258, 256, 256]
    assert tb.token_ids[1].tolist() == [260, 49, 50, 258, 261, 53, 54, 258]
    assert tb.attention_mask[0].tolist() == [1] * 6 + [0] * 2
    # Target k + 1 at position k: the sampled tokens of "a" are targets 4 and 5 -> positions 3 and 4.
    assert tb.mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0]
    assert tb.logp_behaviour[0, 3:5].tolist() == pytest.approx([-0.1, -0.2])
    assert tb.mask[1].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert tb.advantages.tolist() == [1.0, -1.0] and tb.tokens == 5


def test_no_trainable_record_gives_no_batch() -> None:
    assert to_tensors([_record("c", [260, 261], [55], [-1.0], None)], 256) is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"logprobs": [None, None, None]}, r"logprobs\[2\]"),
        ({"loss_mask": [0, 1]}, "differ in length"),
        ({"sampling": {"temperature": 1.0, "top_p": 0.9, "top_k": -1}}, "top_p"),
        ({"sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": -1}}, "temperature"),
    ],
)
def test_bad_records_are_refused_with_one_line_naming_the_rollout_and_field(change: dict, field: str) -> None:
    rec = {**_record("r1", [260, 261], [55], [-1.0], 1.0), **change}
    with pytest.raises(BatchError, match=field) as err:
        to_tensors([rec], 256)
    assert "rollout r1" in str(err.value) and "\n" not in str(err.value)


def test_records_of_different_temperatures_are_refused() -> None:
    a = _record("a", [260, 261], [55], [-1.0], 1.0)
    b = _record("b", [260, 261], [55], [-1.0], 1.0, temperature=0.5)
    with pytest.raises(BatchError, match="several temperatures"):
        to_tensors([a, b], 256)


# -- one step on the bundled policy -----------------------------------------------------------------------

PROMPT = [260, *b"12+30=", 258, 261]


def test_a_step_raises_the_logprob_of_a_rewarded_answer_and_lowers_a_punished_one() -> None:
    torch.manual_seed(0)
    model = load_policy(MODEL)
    good, bad = [*b"42", 258], [*b"24", 258]

    def scored(answer: list[int]) -> list[float]:
        ids = torch.tensor([PROMPT + answer])
        with torch.no_grad():
            return token_logprobs(model(input_ids=ids).logits, ids)[0, len(PROMPT) - 1 :].tolist()

    before_good, before_bad = scored(good), scored(bad)
    recs = [_record("g", PROMPT, good, before_good, 1.0), _record("b", PROMPT, bad, before_bad, -1.0)]
    ts = TrainerSettings(lr=1e-4, warmup_steps=1)
    stats = train_step(model, Optimiser.for_model(model, ts), to_tensors(recs, 256), ts)
    assert stats["ratio_first"] == pytest.approx(1.0, abs=1e-5)  # recorded = current at the first update
    assert sum(scored(good)) > sum(before_good)
    assert sum(scored(bad)) < sum(before_bad)


# -- checkpoints and versions -----------------------------------------------------------------------------


def test_saved_version_is_a_complete_checkpoint_written_once(tmp_path: Path) -> None:
    model = load_policy(MODEL)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    out = save_policy(model, MODEL, tmp_path / "v1")
    saved, source = load_file(out / "model.safetensors"), load_file(MODEL / "model.safetensors")
    assert set(saved) == set(source)
    assert torch.equal(saved["lm_head.weight"], model.lm_head.weight.detach())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (MODEL / name).read_bytes()
    assert weights_hash(out) != weights_hash(MODEL)
    assert torch.equal(load_policy(out).lm_head.weight, model.lm_head.weight.detach())
    with pytest.raises(PolicyIOError, match="already exists"):
        save_policy(model, MODEL, out)


def test_next_version_skips_ids_in_the_store_and_on_disk(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "home")
    root = tmp_path / "policies"
    assert next_version(store, root) == "v0"
    store.put_policy("v0", "h0", "/x", [])
    (root / "v1").mkdir(parents=True)  # left by a crash between save and publish
    assert next_version(store, root) == "v2"


# -- the loop config --------------------------------------------------------------------------------------


def test_example_loop_config_loads_with_overrides() -> None:
    cfg, ts = load_loop_config(EXAMPLE, ["trainer.lr=1e-3", "run.num_groups=4"])
    assert ts.lr == 1e-3 and cfg.run.num_groups == 4 and cfg.run.env == "math"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("[trainer]\nlr = -1\n", "trainer.lr"),
        ("[trainer]\nlearning_rate = 1e-3\n", "trainer.learning_rate"),
        ("[run]\ngroup_size = 0\n", "run.group_size"),
        ("trainer = 3\n", "trainer: must be a table"),
    ],
)
def test_bad_loop_config_is_one_line_naming_file_and_field(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "loop.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_loop_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and where in msg and "\n" not in msg


# -- the stack records the bundled policy as v0 -----------------------------------------------------------


@pytest.fixture
def fake_engine() -> Iterator[str]:
    """Answers the two control reads a publish makes first: the engine already serves v0, unpaused."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = {"/weight_info": {"weight_version": "v0"}, "/is_paused": {"is_paused": False}}.get(
                self.path
            )
            data = json.dumps(body or {}).encode()
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # a publish must not touch an engine that already serves the version
            raise AssertionError(f"unexpected POST {self.path}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_stack_records_the_bundled_policy_as_published_v0_once(tmp_path: Path, fake_engine: str) -> None:
    from durable_rollouts.config.models import StackConfig
    from durable_rollouts.stack.stack import _register_policy

    cfg = StackConfig(model_dir=str(MODEL))
    store = RunStore(tmp_path)
    with pytest.raises(Exception, match="never published"):
        TrainerFeed(store, "r").take(1, "v0", 1)
    _register_policy(cfg, tmp_path, fake_engine)
    _register_policy(cfg, tmp_path, fake_engine)  # a second `up` of the same home
    rows = store.policies()
    assert [(r["version"], r["status"]) for r in rows] == [("v0", "published")]
    assert rows[0]["weights_hash"] == weights_hash(MODEL) and rows[0]["engines"] == [fake_engine]
    assert TrainerFeed(store, "r").take(1, "v0", 1).groups == []  # the feed now accepts v0


def test_stack_refuses_a_v0_bound_to_other_weights(tmp_path: Path, fake_engine: str) -> None:
    from durable_rollouts.config.models import StackConfig
    from durable_rollouts.stack.procs import StackError
    from durable_rollouts.stack.stack import _register_policy

    RunStore(tmp_path).put_policy("v0", "0" * 64, "/elsewhere", [])
    with pytest.raises(StackError, match="immutable"):
        _register_policy(StackConfig(model_dir=str(MODEL)), tmp_path, fake_engine)
