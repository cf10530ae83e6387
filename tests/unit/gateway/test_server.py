"""The gateway's HTTP side (gateway/server.py) on a real Unix socket: per-rollout key, OpenAI errors, a
repeated request answered from the store without a second signal or sample."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from durable_rollouts.contracts.harness import GatewayCallInput
from durable_rollouts.gateway.server import GatewayServer, gateway_key
from durable_rollouts.gateway.turn import GatewayTurns
from durable_rollouts.sandboxes.base import GATEWAY_ROOT_ENV, gateway_dir
from durable_rollouts.store import RunStore
from tests.unit.gateway.test_gateway import REF, RID, SAMPLING, ScriptedEngine

CALL = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'


@pytest.fixture
async def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(GATEWAY_ROOT_ENV, str(tmp_path / "gw"))
    store = RunStore(tmp_path / "home")
    engine = ScriptedEngine([CALL, "done"])
    server = GatewayServer(store, secret="s")
    turns = GatewayTurns(store, engine)
    signals: list[int] = []
    running: set[asyncio.Task[None]] = set()

    async def signal(rollout_id: str, index: int) -> None:  # what the workflow's gateway_call activity does
        signals.append(index)

        async def answer() -> None:
            inp = GatewayCallInput(ref=REF, index=index, engine_url="http://e",
                                   sampling=SAMPLING, max_tokens=512, max_total_tokens=0)  # fmt: skip
            await turns.answer(inp)
            server.notify(rollout_id, index)

        task = asyncio.ensure_future(answer())
        running.add(task)
        task.add_done_callback(running.discard)

    path = await server.serve(RID, "tiny", signal)
    conn = aiohttp.UnixConnector(path=path)
    async with aiohttp.ClientSession(connector=conn) as http:
        yield http, path, signals, engine, store
    await server.aclose()
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
