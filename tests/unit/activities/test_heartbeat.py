"""activities/heartbeat.py: a regular activity heartbeats while it waits; a local activity does not."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from temporalio.testing import ActivityEnvironment

from durable_rollouts.activities import heartbeat


async def slow() -> str:
    await asyncio.sleep(0.2)
    return "done"


async def beats_while_waiting(local: bool) -> tuple[str, int]:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, is_local=local)
    beats: list[tuple] = []
    env.on_heartbeat = lambda *details: beats.append(details)
    result = await env.run(heartbeat.heartbeating, slow())
    return result, len(beats)


@pytest.mark.parametrize("local", [False, True])
async def test_only_a_regular_activity_heartbeats_while_it_waits(
    monkeypatch: pytest.MonkeyPatch, local: bool
) -> None:
    monkeypatch.setattr(heartbeat, "HEARTBEAT_EVERY_S", 0.02)
    result, beats = await beats_while_waiting(local)
    assert result == "done"
    assert (beats == 0) if local else (beats >= 3), beats
