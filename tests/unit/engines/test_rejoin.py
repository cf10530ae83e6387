"""Which engines are held out of rotation until they serve the current policy version (engines/rejoin.py):
the version an engine needs, from the store's publish history, and the gate a worker's turns and
dispatcher ask, against the simulated engine's real /weight_info."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from durable_rollouts.engines.rejoin import EngineGate, Held, required
from durable_rollouts.errors import EngineUnavailable
from durable_rollouts.simengine import SimEngine, SimSettings
from durable_rollouts.store import RunStore

A, B = "http://a:1", "http://b:1"


def rows(*published: tuple[str, list[str]], publishing: tuple[str, list[str]] | None = None) -> list[dict]:
    out: list[dict[str, Any]] = [
        {"seq": i + 1, "version": v, "engines": e, "status": "published", "weights_dir": f"/w/{v}"}
        for i, (v, e) in enumerate(published)
    ]
    if publishing is not None:
        v, e = publishing
        out.append({"seq": len(out) + 1, "version": v, "engines": e, "status": "publishing"})
    return out


def test_an_engine_behind_the_newest_version_published_to_it_needs_that_version() -> None:
    history = rows(("v0", [A, B]), ("v1", [A, B]), ("v2", [A]))
    assert required(history, A, "v0")["version"] == "v2"  # type: ignore[index]
    assert required(history, A + "/", "default")["version"] == "v2"  # type: ignore[index]
    assert required(history, B, "v0")["version"] == "v1"  # type: ignore[index]  # v2 never went to B
    assert required(history, A, "v2") is None
    assert required(history, B, "v1") is None


def test_a_new_replica_needs_the_newest_published_version() -> None:
    history = rows(("v0", [A]), ("v1", [A]))
    assert required(history, B, "default")["version"] == "v1"  # type: ignore[index]
    assert required(history, B, "v0")["version"] == "v1"  # type: ignore[index]


def test_nothing_is_held_back_outside_a_publish_history_or_when_the_engine_cannot_tell() -> None:
    assert required([], A, "default") is None
    assert required(rows(publishing=("v0", [A])), A, "default") is None  # nothing published yet
    assert required(rows(("v0", [A])), A, None) is None


def test_an_engine_ahead_of_the_store_is_never_rolled_back() -> None:
    # A publish of v2 under way: the engine serves it before the store marks it published.
    history = rows(("v0", [A]), ("v1", [A]), publishing=("v2", [A]))
    assert required(history, A, "v2") is None
    assert required(history, A, "v0")["version"] == "v1"  # type: ignore[index]


@pytest.mark.timeout(60)
async def test_the_gate_holds_a_stale_engine_out_and_admits_it_once_current(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    async with SimEngine(SimSettings(policy="random", weight_version="v0")).serve(port=0) as url:
        gate = EngineGate(store)
        try:
            await gate.admit(url)  # no published version: nothing asked, nothing held
            for v in ("v0", "v1"):
                store.put_policy(v, f"h{v}", str(tmp_path / v), [url])
                store.finish_policy(v, [url])
            with pytest.raises(EngineUnavailable, match="serves policy version v0, the current one is v1"):
                await gate.admit(url)
            held = await gate.held(url)
            assert held == Held(url, "v0", "v1")
            # The simulated engine cannot reload weights: the push fails (logged) and is not started
            # again at once, whoever asks.
            await asyncio.to_thread(gate.pushes.wait, 30)  # the engine serves on this loop
            assert not gate.pushes.start(url, "v1")
            async with httpx.AsyncClient() as http:  # what a finished push leaves: the engine's label
                reply = await http.post(f"{url}/update_weight_version", json={"new_version": "v1"})
                reply.raise_for_status()
            await gate.admit(url)
            assert await gate.held(url) is None
        finally:
            await gate.aclose()


@pytest.mark.timeout(60)
async def test_an_engine_that_does_not_answer_is_not_held_out_by_the_gate(tmp_path: Path) -> None:
    """Its turn fails on its own (the engine is down); the gate has nothing to push to."""
    store = RunStore(tmp_path)
    store.put_policy("v0", "h", str(tmp_path), ["http://127.0.0.1:9"])
    store.finish_policy("v0", ["http://127.0.0.1:9"])
    gate = EngineGate(store)
    try:
        await gate.admit("http://127.0.0.1:9")
    finally:
        await gate.aclose()


@pytest.mark.timeout(60)
async def test_the_dispatchers_poll_gives_no_reading_of_a_stale_engine_so_it_is_not_healthy(
    tmp_path: Path,
) -> None:
    from temporalio.testing import ActivityEnvironment

    from durable_rollouts.activities.dispatch import DispatchActivities
    from durable_rollouts.contracts.dispatch import PollFleetInput
    from durable_rollouts.sandboxes.pool import SandboxPool

    store = RunStore(tmp_path)
    async with SimEngine(SimSettings(policy="random", weight_version="v0")).serve(port=0) as url:
        acts = DispatchActivities(store, SandboxPool(store))
        inp = PollFleetInput(run_id="r", engine_urls=[url], groups=[])
        try:
            for v in ("v0", "v1"):
                store.put_policy(v, f"h{v}", str(tmp_path / v), [url])
                store.finish_policy(v, [url])
            held = await ActivityEnvironment().run(acts.poll_fleet, inp)
            assert held.readings == []
            assert held.errors == [Held(url, "v0", "v1").describe()]
            async with httpx.AsyncClient() as http:
                reply = await http.post(f"{url}/update_weight_version", json={"new_version": "v1"})
                reply.raise_for_status()
            back = await ActivityEnvironment().run(acts.poll_fleet, inp)
            assert [r.engine_id for r in back.readings] == [url] and back.errors == []
        finally:
            await asyncio.to_thread(acts.gate.pushes.wait, 30)  # the engine serves on this loop
            await acts.aclose()
