"""A restarted engine rejoins at the current policy (real vLLM-CPU, real Temporal, an in-process worker).

Two versions are published after the bundled one, a run starts, and the engine is SIGKILLed mid-run and
started again from its command line by the fault kit: it comes back serving the bundled weights under the
label ``default``. The worker holds it out of rotation and pushes the current version to it; no token is
sampled by it while it is stale, and every token of the run carries the current version. The run admits
groups at a fixed cap (no dispatcher polls), so the hold and the push are the model turns' own (the
dispatcher's hold is tested in tests/unit/engines/test_rejoin.py).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client

from durable_rollouts.engines.policy import publish
from durable_rollouts.faults import process as pfaults
from durable_rollouts.stack import procs
from tests.conftest import MODEL_DIR, Engine, start_engine
from tests.integration.support import export, make_config, start_run, worker

START_S = 600
"""How long a (re)started engine may take to serve: about 40 s here, minutes when the CPUs are shared."""
# "What is 12+30?" through the bundled chat template.
QUESTION = [260, 87, 104, 97, 116, 32, 105, 115, 32, 49, 50, 43, 51, 48, 63, 258, 261]


@pytest.fixture
def eng(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The test's own engine (it is killed and its weights change); stopped whole by its pid file."""
    engine = start_engine(tmp_path_factory.mktemp("rejoin-engine"), health_timeout_s=START_S)
    try:
        yield engine
    finally:
        rec = procs.read_record(engine.home, "engine")
        if rec is not None:
            procs.stop_record(rec)  # the running engine's whole tree, the restarted one's included
        else:
            procs.stop_pid(engine.pid)


def perturbed(out: Path) -> Path:
    """A copy of the bundled policy with Gaussian noise (10 % of each tensor's std) on every weight."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(MODEL_DIR, out)
    gen = torch.Generator().manual_seed(0)
    tensors = load_file(MODEL_DIR / "model.safetensors")
    noisy = {k: v + 0.1 * v.std() * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}
    save_file(noisy, out / "model.safetensors", metadata={"format": "pt"})
    return out


async def scores(http: httpx.AsyncClient, url: str) -> list[float]:
    """The engine's logprobs of QUESTION's tokens (its current weights)."""
    body = {
        "model": "tiny",
        "token_ids": QUESTION,
        "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False},
        "output_mode": "tokens",
    }
    resp = await http.post(f"{url}/inference/v1/generate", json=body)
    resp.raise_for_status()
    scored = resp.json()["prompt_logprobs"]
    return [float(scored[i][str(t)]["logprob"]) for i, t in enumerate(QUESTION) if i > 0]


def counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def watch_rejoin(http: httpx.AsyncClient, url: str, current: str) -> list[tuple[str, float]]:
    """From the restart until the engine serves ``current``: each stale version seen, with the prompt
    tokens the engine had processed by then (read before the version, so they were all processed while
    it was stale)."""
    stale: list[tuple[str, float]] = []
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            prompt_tokens = counter((await http.get(f"{url}/metrics")).text, "vllm:prompt_tokens_total")
            version = (await http.get(f"{url}/weight_info")).json()["weight_version"]
        except httpx.HTTPError:  # not serving yet
            await asyncio.sleep(0.05)
            continue
        if version == current:
            return stale
        stale.append((version, prompt_tokens))
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine {url} never served {current} after its restart (last seen: {stale[-1:]})")


@pytest.mark.timeout(1500)
async def test_an_engine_killed_and_restarted_after_two_publishes_rejoins_at_the_current_version(
    client: Client, eng: Engine, task_queue: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="durable_rollouts.engines.rejoin")
    run_id = "rejoin"
    cfg = make_config(
        [eng.url], task_queue,
        run={"num_groups": 16, "group_size": 2, "max_inflight_groups": 2},
        sampling={"max_tokens": 48, "min_tokens": 48},
        engine={"max_attempts": 100, "retry_max_s": 1.0, "outage_budget_s": 900},  # waits out the restart
    )  # fmt: skip
    v2_dir = perturbed(tmp_path / "v2")
    async with httpx.AsyncClient(timeout=60) as http, worker(client, task_queue, tmp_path) as store:
        bundled = await scores(http, eng.url)
        for version, weights in (("v0", MODEL_DIR), ("v1", MODEL_DIR), ("v2", v2_dir)):
            await asyncio.to_thread(publish, [eng.url], version, weights, store, http=None)
        before_kill = await scores(http, eng.url)
        assert max(abs(a - b) for a, b in zip(before_kill, bundled, strict=True)) > 1e-3  # v2: other weights
        handle = await start_run(client, cfg, run_id)
        for _ in range(600):
            if sum(store.count_rollouts(run_id).values()) >= 2:
                break
            await asyncio.sleep(0.1)
        (target,) = pfaults.targets(eng.home, "engine")
        await asyncio.to_thread(pfaults.restart, target)
        done_at_kill = sum(store.count_rollouts(run_id).values())
        stale = await watch_rejoin(http, eng.url, "v2")
        result = await asyncio.wait_for(handle.result(), 240)
        generated = counter((await http.get(f"{eng.url}/metrics")).text, "vllm:generation_tokens_total")
        after = await scores(http, eng.url)
        rollouts, _ = export(store, run_id)
        row: dict[str, Any] = store.get_policy("v2")  # type: ignore[assignment]
    assert stale and stale[0][0] == "default", stale  # it came back stale, and was seen so
    assert all(tokens == 0 for _, tokens in stale), stale  # no request reached it while stale
    assert max(abs(a - b) for a, b in zip(after, before_kill, strict=True)) < 1e-4  # v2's weights again
    assert row["engines"] == [eng.url.rstrip("/")]
    assert f"engine {eng.url} rejoined at policy version v2" in caplog.messages  # the worker pushed it
    assert result.done and result.outcomes.get("failed", 0) == 0, result.outcomes
    assert len(rollouts) == 32 and done_at_kill < 32  # rollouts were left for the restarted engine
    assert generated > 0  # and it sampled them
    versions = {v for r in rollouts for v in r["policy_versions"] if v is not None}
    assert versions == {"v2"}, versions
