"""Adaptive admission against a real vLLM-CPU engine with a deliberately small KV cache.

The engine gets 20 blocks of 32 tokens (``--num-gpu-blocks-override``): a few multi-turn math rollouts
fill it. Started all at once, the same rollouts overflow it and vLLM preempts (recomputes) requests; under
the prime-rl preset (starting at KV capacity / max length) the cap grows only while there is headroom,
is trimmed when a poll sees usage over 80 % and cut on the first preemptions, and the run completes with a
few preemptions, never a storm. The probe preset (the default) admits more than KV capacity / max length
(most rollouts never reach the full length; the ramp, rule P0, doubles it from the first poll while the
cache is empty) without a preemption storm (rule P1) in its dispatch log.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client

from engines.metrics import parse_metrics
from tests.conftest import Engine, start_engine
from tests.integration.support import export, make_config, run_to_end, worker

BLOCKS, BLOCK = 40, 32
ROLLOUT_MAX = 400
"""Tokens one rollout may reach (prompt + turns): 13 blocks, so the cache holds three at full length."""


@pytest.fixture(scope="module")
def small_kv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from workers import procs

    eng = start_engine(
        tmp_path_factory.mktemp("small-kv"), max_model_len=512, num_gpu_blocks=BLOCKS, block_size=BLOCK
    )
    yield eng
    procs.stop_pid(eng.pid)


def preemptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return parse_metrics(text, url=url, engine_id=url, at=0.0).preemptions_total


def run_config(url: str, task_queue: str, **admission: object):
    return make_config(
        [url],
        task_queue,
        run={"num_groups": 8, "group_size": 4, "max_inflight_groups": 8},
        rollout={"max_turns": 4, "max_total_tokens": ROLLOUT_MAX},
        # every turn samples 64 tokens (the answer is wrong, so the rollout retries): contexts grow fast
        sampling={"max_tokens": 64, "min_tokens": 64},
        # the most KV one rollout can hold is its own token limit: initial cap = 1280 / 400 = 3
        admission={"max_model_len": ROLLOUT_MAX, "poll_interval_s": 0.25, "admit_window_s": 0.0, **admission},
    )


@pytest.mark.timeout(900)
async def test_the_controller_trims_before_a_small_kv_cache_fills_and_avoids_a_preemption_storm(
    client: Client, small_kv: Engine, task_queue: str, tmp_path: Path
) -> None:
    info = httpx.get(f"{small_kv.url}/metrics", timeout=10).text
    assert parse_metrics(info, url="e", engine_id="e", at=0).kv_capacity_tokens == BLOCKS * BLOCK
    async with worker(client, task_queue, tmp_path) as store:
        before = preemptions(small_kv.url)
        flood = await run_to_end(client, run_config(small_kv.url, task_queue), "flood")
        flooded = preemptions(small_kv.url) - before
        adaptive_cfg = run_config(
            small_kv.url, task_queue, enabled=True, preset="prime-rl", grow_turnover=0.5
        )
        before = preemptions(small_kv.url)
        adaptive = await run_to_end(client, adaptive_cfg, "adaptive")
        adapted = preemptions(small_kv.url) - before
        log = store.dispatch_log("adaptive")
    assert flood.done and adaptive.done
    rollouts, _ = export(store, "adaptive")
    assert len({r["rollout_id"] for r in rollouts}) == len(rollouts) >= 32
    assert all(r["outcome"] in ("completed", "truncated", "cancelled") for r in rollouts)
    usage = [e["kv_usage"] for e in log if e["kv_usage"] is not None]
    trims = [
        e for e in log if any("trim" in why or "cut" in why or "preemption" in why for why in e["reasons"])
    ]
    print(f"\npreemptions: all at once {flooded:.0f}, adaptive {adapted:.0f}; peak usage {max(usage):.2f}; "
          f"caps {sorted({e['cap'] for e in log})}; {len(trims)} trims/cuts")  # fmt: skip
    assert flooded > 0, "the flood must overflow the small cache (otherwise this test shows nothing)"
    # It reacts: a trim on KV usage over 80 % when a poll catches it (the tiny model's turns are short, so
    # usage peaks between polls), else a cut on the first preemptions; either way no storm follows.
    assert trims or adapted == 0, "preemptions, and the controller never trimmed or cut"
    assert adapted <= max(2, flooded // 3), f"preemption storm: {adapted} vs {flooded} without admission"


@pytest.mark.timeout(300)
async def test_the_probe_admits_past_the_kv_cap_without_a_preemption_storm(
    client: Client, small_kv: Engine, task_queue: str, tmp_path: Path
) -> None:
    kv_cap = BLOCKS * BLOCK // ROLLOUT_MAX  # 3: what every rollout at its full length would need
    cfg = run_config(small_kv.url, task_queue, enabled=True, preset="probe", max_inflight=32)
    async with worker(client, task_queue, tmp_path) as store:
        before = preemptions(small_kv.url)
        result = await run_to_end(client, cfg, "probe")
        preempted = preemptions(small_kv.url) - before
        log = store.dispatch_log("probe")
    assert result.done
    rollouts, _ = export(store, "probe")
    assert len({r["rollout_id"] for r in rollouts}) == len(rollouts) == 32  # every rollout ended once
    assert all(r["outcome"] in ("completed", "truncated") for r in rollouts)  # the probe cancels nothing
    caps, inflight = [e["cap"] for e in log], [e["inflight"] for e in log]
    storms = [e for e in log if any("preemption storm" in why for why in e["reasons"])]
    print(f"\nprobe: caps {sorted(set(caps))}, most in flight {max(inflight)}, {preempted:.0f} preemptions")
    # it starts at the KV cap, and the first poll (idle engine, nothing preempted) ramps it at once (P0)
    assert log[0]["cap"] == 2 * kv_cap, log[0]
    assert any(f"cap {kv_cap} -> {2 * kv_cap}" in why for why in log[0]["reasons"]), log[0]["reasons"]
    assert max(caps) > kv_cap and max(inflight) > kv_cap, "the probe never went past the KV cap"
    assert storms == [], f"preemption storm: {storms[0]['reasons']}"
