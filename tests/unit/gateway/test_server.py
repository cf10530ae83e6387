"""The gateway's HTTP side (gateway/server.py) on a real Unix socket: per-rollout key, OpenAI errors, a
repeated request answered from the store without a second signal or sample."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from durable_rollouts.gateway.server import gateway_key
from durable_rollouts.sandboxes.base import GATEWAY_ROOT_ENV, gateway_dir
from durable_rollouts.store import RunStore
from tests.unit.gateway.test_gateway import RID, ScriptedEngine, answering_gateway

CALL = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'


@pytest.fixture
async def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(GATEWAY_ROOT_ENV, str(tmp_path / "gw"))
    store = RunStore(tmp_path / "home")
    engine = ScriptedEngine([CALL, "done"])
    async with answering_gateway(store, engine) as (http, path, signals):
        yield http, path, signals, engine, store
    assert not os.path.exists(path)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_rollout_socket_answers_its_own_key_only(served: Any) -> None:
    http, path, signals, _, _ = served
    assert os.path.dirname(path) == gateway_dir(RID) and stat.S_IMODE(os.stat(path).st_mode) == 0o666
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post("http://gw/v1/chat/completions", json=body, headers=auth("dr-other")) as resp:
        assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
    key = gateway_key(RID, "s")
    async with http.post("http://gw/v1/chat/completions", json={**body, "n": 2}, headers=auth(key)) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "n"
    async with http.post("http://gw/v1/chat/completions", json={"messages": []}, headers=auth(key)) as r:
        assert r.status == 400
    assert signals == []  # nothing recorded, nothing signalled


async def test_a_repeated_request_is_answered_from_the_store(served: Any) -> None:
    http, _, signals, engine, store = served
    key = gateway_key(RID, "s")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Task id: t"}], "tools": []}
    async with http.post("http://gw/v1/chat/completions", json=body, headers=auth(key)) as resp:
        assert resp.status == 200
        first = await resp.json()
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    assert first["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"command": "ls"}'
    async with http.post("http://gw/v1/chat/completions", json=body, headers=auth(key)) as resp:
        assert resp.status == 200 and await resp.json() == first
    assert signals == [0] and len(engine.prompts) == 1 and len(store.gateway_calls(RID)) == 1
