"""``POST /v1/responses`` on a rollout's real gateway socket (gateway/server.py): a streamed call answered
as Responses events from the stored answer, a stream broken mid-answer and asked again yielding the same
events without a second sample, the output items sent back extending the stored tokens, a sampling setting
other than the run's refused with a 400 naming it before anything is recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from durable_rollouts.gateway.server import gateway_key
from durable_rollouts.sandboxes.base import GATEWAY_ROOT_ENV
from durable_rollouts.store import RunStore
from tests.unit.gateway.test_gateway import RID, ScriptedEngine, answering_gateway

URL = "http://gw/v1/responses"
AUTH = {"Authorization": f"Bearer {gateway_key(RID, 's')}"}
CALL = '<tool_call>{"name": "exec_command", "arguments": {"cmd": "ls"}}</tool_call>'
TOOLS = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}}]
INPUT: list[dict[str, Any]] = [
    {
        "type": "message",
        "role": "developer",
        "content": [{"type": "input_text", "text": "You are an agent."}],
    },
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Task id: t1"}]},
]


def events(raw: bytes) -> list[dict[str, Any]]:
    """The events of a Responses stream, each checked to name its type in its SSE ``event:`` line."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    return out


@pytest.fixture
async def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(GATEWAY_ROOT_ENV, str(tmp_path / "gw"))
    store = RunStore(tmp_path / "home")
    engine = ScriptedEngine([CALL, "All done: " + "x" * 40])
    async with answering_gateway(store, engine, headers=AUTH) as (http, _, signals):
        yield http, signals, engine, store


async def test_a_broken_stream_asked_again_yields_the_same_events(served: Any) -> None:
    http, signals, engine, store = served
    body = {"model": "tiny", "input": INPUT, "tools": TOOLS, "stream": True, "store": False}
    async with http.post(URL, json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        first = events(await resp.read())
    kinds = [e["type"] for e in first]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    call = first[-1]["response"]["output"]
    assert [(o["type"], o["name"], json.loads(o["arguments"])) for o in call] == [
        ("function_call", "exec_command", {"cmd": "ls"})
    ]
    # The next call: the history as Codex sends it back, then the tool's output; its stream is broken.
    nxt = {**body, "input": [*INPUT, *call, {"type": "function_call_output", "call_id": call[0]["call_id"],
                                             "output": "a.txt"}]}  # fmt: skip
    async with http.post(URL, json=nxt) as resp:
        assert resp.status == 200
        head = await resp.content.read(40)  # the client goes away after a few bytes
        resp.close()
    async with http.post(URL, json=nxt) as resp:
        again = events(await resp.read())
    assert head and (b"".join(_sse(e) for e in again)).startswith(head)
    text = "".join(e["delta"] for e in again if e["type"] == "response.output_text.delta")
    assert (
        text == "All done: " + "x" * 40 and again[-1]["response"]["output"][0]["content"][0]["text"] == text
    )
    async with http.post(URL, json=nxt) as resp:
        assert events(await resp.read()) == again
    # Each call sampled once, and the second extends the first's stored tokens exactly.
    assert signals == [0, 1] and len(engine.prompts) == 2
    segs = store.segments(RID)
    assert [s.kind for s in segs] == ["prompt", "model", "observation", "model"]
    assert engine.prompts[1] == [t for s in segs[:3] for t in s.token_ids]
    # Unstreamed, the same call is the stored response as one object.
    async with http.post(URL, json={**nxt, "stream": False}) as resp:
        assert resp.status == 200 and await resp.json() == again[-1]["response"]
    assert len(engine.prompts) == 2


async def test_a_temperature_other_than_the_runs_is_a_400_naming_it(served: Any) -> None:
    http, signals, engine, store = served
    async with http.post(URL, json={"input": INPUT, "temperature": 0.3}) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
    assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
    async with http.post(URL, json={"input": INPUT, "previous_response_id": "resp_x"}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "previous_response_id"
    assert signals == [] and engine.prompts == [] and store.gateway_calls(RID) == []


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
