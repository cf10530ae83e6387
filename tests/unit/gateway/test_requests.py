"""A harness's request fields, honoured or refused, never ignored (gateway/chat.py's `request_options`,
gateway/turn.py, gateway/server.py): the run's sampling settings repeated or refused with a 400 naming the
field; ``max_tokens``, ``stop``, ``tool_choice`` and ``seed`` honoured as docs/harness.md's table says, with
the stored tokens exactly the engine's; a stream served from the stored answer, the same on a retry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from durable_rollouts.engines.client import EngineClient
from durable_rollouts.errors import EngineBadRequest
from durable_rollouts.gateway import chat
from durable_rollouts.gateway.options import IGNORED, BadChatRequest, Options, RunSampling, request_options
from durable_rollouts.gateway.server import GatewayServer, gateway_key
from durable_rollouts.gateway.turn import GatewayTurns
from durable_rollouts.sandboxes.base import GATEWAY_ROOT_ENV
from durable_rollouts.store import RunStore, model_segment
from tests.unit.gateway.test_gateway import (
    BASH,
    REF,
    RID,
    SAMPLING,
    ScriptedEngine,
    answering_gateway,
    call_input,
)

RUN = RunSampling(temperature=1.0, top_p=1.0, top_k=-1, min_tokens=0)
MSGS: list[dict[str, Any]] = [{"role": "user", "content": "Task id: t1"}]
CALL = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
URL = "http://gw/v1/chat/completions"


def options(**body: Any) -> Options:
    return request_options({"messages": MSGS, **body}, RUN)


def refused(run: RunSampling | None = RUN, **body: Any) -> BadChatRequest:
    with pytest.raises(BadChatRequest) as info:
        request_options({"messages": MSGS, **body}, run)
    return info.value


def test_a_sampling_setting_other_than_the_runs_is_refused_naming_it() -> None:
    for field, value in [("temperature", 0.7), ("top_p", 0.9), ("top_k", 20), ("min_tokens", 5)]:
        e = refused(**{field: value})
        assert e.param == field and e.code == "unsupported_value" and str(value) in str(e)
        assert e.body()["error"] == {
            "message": str(e), "type": "invalid_request_error", "param": field, "code": "unsupported_value"
        }  # fmt: skip
    assert options(temperature=1, top_p=1.0, top_k=0, min_tokens=0) == Options()  # the run's (top_k off)
    for field, value in [
        ("presence_penalty", 0.5), ("frequency_penalty", -1), ("logit_bias", {"42": 5}), ("logprobs", True),
        ("top_logprobs", 3), ("repetition_penalty", 1.1), ("min_p", 0.05), ("parallel_tool_calls", False),
        ("response_format", {"type": "json_object"}),
    ]:  # fmt: skip
        assert refused(**{field: value}).param == field
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": False}
    assert options(**neutral, top_logprobs=None, parallel_tool_calls=True) == Options()
    assert (
        refused(run=None, temperature=1.0).param == "temperature"
    )  # the run's settings unknown: not checked
    assert (
        refused(temperature="hot").code == "invalid_type" and refused(temperature=True).code == "invalid_type"
    )


def test_n_tool_choice_streaming_and_unknown_fields() -> None:
    assert refused(n=2).param == "n" and options(n=1) == Options()
    for choice in ("required", {"type": "function", "function": {"name": "bash"}}):
        e = refused(tool_choice=choice)
        assert e.param == "tool_choice" and "constrained decoding" in str(e)
    assert options(tool_choice="none").tool_choice == "none" and options(tool_choice="auto") == Options()
    assert options(tool_choice="none").offered([BASH]) is None and options().offered([BASH]) == [BASH]
    e = refused(functions=[{"name": "bash"}])
    assert e.param == "functions" and e.code == "unsupported_parameter"
    assert options(model="anything", user="u", metadata={"a": "b"}, store=False) == Options()
    assert set(IGNORED) >= {"model", "user"}  # each with its reason (docs/harness.md's table)
    assert refused(stream_options={"include_usage": True}).param == "stream_options"  # only with stream
    assert options(stream=True, stream_options={"include_usage": True}).include_usage
    assert options(stream=True).stream and not options(stream=True).include_usage
    assert refused(stream="yes").param == "stream"


def test_max_tokens_stop_and_seed_parse() -> None:
    assert options(max_tokens=50, max_completion_tokens=20).max_tokens == 20  # the smaller wins
    assert options(max_completion_tokens=7).max_tokens == 7
    assert refused(max_tokens=0).param == "max_tokens" and refused(max_tokens=True).code == "invalid_type"
    assert options(stop="\n").stop == ("\n",) and options(stop=["a", "b", "a"]).stop == ("a", "b")
    assert options(stop=None).stop == () and options(stop=[]).stop == ()
    assert refused(stop=[""]).param == "stop" and refused(stop=[1]).param == "stop"
    assert options(seed=3).seed == 3 and refused(seed=1.5).param == "seed"


def test_options_are_recorded_and_keyed_only_when_asked() -> None:
    key = chat.request_key(MSGS, [BASH])
    assert chat.request_key(MSGS, [BASH], Options()) == key  # a plain request keeps its key
    assert chat.request_key(MSGS, [BASH], options(stream=True)) == key  # streaming is presentation only
    asked = options(max_tokens=9, stop=["X"], seed=4, tool_choice="none")
    assert chat.request_key(MSGS, [BASH], asked) != key
    assert asked.recorded() == {"max_tokens": 9, "stop": ["X"], "seed": 4, "tool_choice": "none"}
    assert Options.of_request({"messages": MSGS, "options": asked.recorded()}) == asked
    assert Options.of_request({"messages": MSGS}) == Options()


def test_the_answer_ends_before_the_first_stop_string() -> None:
    assert chat.cut_at_stop("Thought: ls\nObservation: x", ("Observation:", "ls")) == ("Thought: ", True)
    assert chat.cut_at_stop("abc", ("z",)) == ("abc", False) and chat.cut_at_stop("abc", ()) == ("abc", False)


def test_stream_chunks_rebuild_the_stored_answer() -> None:
    parsed = chat.parse_answer("Let me look at the files in this directory first.\n" + CALL, 0)
    body = chat.completion(RID, 0, "tiny", parsed, "stop", 10, 30)
    chunks = chat.stream_chunks(body, include_usage=True)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == body["id"] for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == body["choices"][0]["message"]["content"]
    assert sum(1 for d in deltas if d.get("content")) > 2  # the text in several chunks
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls == [{"index": 0, **body["choices"][0]["message"]["tool_calls"][0]}]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    plain = chat.stream_chunks(body, include_usage=False)
    assert "usage" not in plain[0] and len(plain) == len(chunks) - 1
    assert chat.stream_chunks(body, True) == chunks  # a pure function of the stored answer


async def test_the_engine_client_asks_vllm_to_stop_on_the_strings() -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 64}]})
        bodies.append(json.loads(request.content))
        content = [{"token_id": 5, "logprob": -0.1}]
        return httpx.Response(200, json={"choices": [{"token_ids": [5], "logprobs": {"content": content}}]})

    client = EngineClient()
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    await client.generate("http://e", "tiny", [1, 2], SAMPLING, 4, "r/1", stop=["\n", "Observation:"])
    await client.generate("http://e", "tiny", [1, 2], SAMPLING, 4, "r/2")
    await client.aclose()
    params = [b["sampling_params"] for b in bodies]
    # vLLM checks stop strings on its detokenized text: it refuses stop with detokenize false
    assert params[0]["stop"] == ["\n", "Observation:"] and params[0]["detokenize"] is True
    assert "stop" not in params[1] and params[1]["detokenize"] is False  # no stop: tokens only, as before
    assert params[0]["seed"] == params[1]["seed"] == SAMPLING.seed


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "home")


async def answer(
    store: RunStore, turns: GatewayTurns, messages: list[dict[str, Any]], **body: Any
) -> dict[str, Any]:
    """One harness request as the HTTP side records it (its options checked), answered, read back."""
    opts = request_options({"messages": messages, **body}, RUN)
    request: dict[str, Any] = {"messages": messages, "tools": [BASH], "options": opts.recorded()}
    call = store.open_call(RID, chat.request_key(messages, [BASH], opts), request)
    await turns.answer(call_input(call.index))
    stored = store.get_call(RID, call.index)
    assert stored is not None and stored.response is not None
    return stored.response


async def test_stop_ends_the_sample_at_the_engine_and_the_next_call_extends_its_tokens(
    store: RunStore,
) -> None:
    eng = ScriptedEngine(["Thought: list files\nObservation: (made up)", "done"])
    turns = GatewayTurns(store, eng)
    out = await answer(store, turns, MSGS, stop=["Observation:", "never"])
    assert eng.asked[0]["stop"] == ["Observation:", "never"]
    choice = out["choices"][0]
    assert choice["message"]["content"] == "Thought: list files\n" and choice["finish_reason"] == "stop"
    seg = store.get_segment(RID, model_segment(0))
    assert seg is not None and seg.token_ids == eng.returned[0]  # stored exactly as the engine returned them
    assert seg.logprobs is not None and len(seg.logprobs) == len(seg.token_ids)
    text = eng.tok.decode(seg.token_ids)
    assert text.endswith("Observation:") and "Observation:" not in eng.tok.decode(seg.token_ids[:-1])
    assert seg.meta["request"] == {"stop": ["Observation:", "never"]}
    assert out["usage"]["completion_tokens"] == len(seg.token_ids)
    # The harness sends the answer back as it got it (cut): the next call extends the stored tokens.
    msgs2 = [*MSGS, choice["message"], {"role": "user", "content": "ok"}]
    await answer(store, turns, msgs2)
    segs = store.segments(RID)
    assert [s.kind for s in segs] == ["prompt", "model", "observation", "model"]
    assert eng.prompts[1] == [t for s in segs[:3] for t in s.token_ids]
    assert eng.prompts[1][len(eng.prompts[0]) :][: len(seg.token_ids)] == seg.token_ids
    assert eng.asked[1]["stop"] is None  # the next request asked for none


async def test_max_tokens_lowers_the_calls_cap_never_raises_it(store: RunStore) -> None:
    eng = ScriptedEngine(["a long answer", "short"])
    turns = GatewayTurns(store, eng)
    out = await answer(store, turns, MSGS, max_tokens=3)
    assert eng.asked[0]["max_tokens"] == 3
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 3
    msgs2 = [*MSGS, out["choices"][0]["message"], {"role": "user", "content": "go on"}]
    await answer(store, turns, msgs2, max_completion_tokens=100_000)
    assert eng.asked[1]["max_tokens"] == 512  # the run's cap (sampling.max_tokens) wins


async def test_tool_choice_none_offers_no_tools_and_parses_no_tool_call(store: RunStore) -> None:
    eng = ScriptedEngine([CALL, "ok"])
    turns = GatewayTurns(store, eng)
    out = await answer(store, turns, MSGS, tool_choice="none")
    assert eng.rendered_tools[0] is None  # the template rendered the prompt without tools
    message = out["choices"][0]["message"]
    assert message["content"] == CALL and "tool_calls" not in message  # a tool call is not parsed
    assert out["choices"][0]["finish_reason"] == "stop"
    # The next call offers the tools again: its prompt differs from the stored one, a new sequence starts.
    await answer(store, turns, [*MSGS, message, {"role": "user", "content": "now use it"}])
    ctx = store.get_segment(RID, "c00001.ctx")
    assert ctx is not None and ctx.kind == "context" and "tools offered differ" in ctx.meta["rewrite"]["why"]
    assert eng.rendered_tools[-1] == [BASH]


async def test_a_seed_is_recorded_and_the_rollout_samples_with_its_own(store: RunStore) -> None:
    seen: list[int | None] = []
    eng = ScriptedEngine(["x"])
    generate = eng.generate

    async def spy(url: str, model: str, prompt: list[int], sampling: Any, *rest: Any, **kw: Any) -> Any:
        seen.append(sampling.seed)
        return await generate(url, model, prompt, sampling, *rest, **kw)

    eng.generate = spy  # type: ignore[method-assign]
    await answer(store, GatewayTurns(store, eng), MSGS, seed=1234)
    seg = store.get_segment(RID, model_segment(0))
    assert seg is not None and seg.meta["request"] == {"seed": 1234} and seen == [SAMPLING.seed]


async def test_an_engine_that_refuses_stop_answers_a_400_naming_it(store: RunStore) -> None:
    eng = ScriptedEngine(["x"])

    async def no_stop(*args: Any, stop: list[str] | None = None) -> Any:
        raise EngineBadRequest("http://e: HTTP 400: sampling_params.stop: Extra inputs are not permitted")

    eng.generate = no_stop  # type: ignore[method-assign]
    out = await answer(store, GatewayTurns(store, eng), MSGS, stop="\n")
    assert out["error"]["param"] == "stop" and "Extra inputs" in out["error"]["message"]
    call = store.get_call(RID, 0)
    assert call is not None and call.status == 400 and call.detail is not None
    assert call.detail["refused"] == "stop" and call.detail["start"] == call.detail["end"]


async def test_the_runs_sampling_is_read_from_its_stored_config(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "home")
    store.register_run("a", json.dumps({"sampling": {"temperature": 0.6, "top_k": 40}}), "h")
    store.register_run("b", json.dumps({"sampling": {"temperature": "hot"}}), "h")
    server = GatewayServer(store, secret="s")
    assert await server.run_sampling("a/g000000/3r1") == RunSampling(0.6, 1.0, 40, 0)
    assert await server.run_sampling("b/g000000/0") is None  # unreadable: every sampling field refused
    assert await server.run_sampling("c/g000000/0") is None  # not in the store


@pytest.fixture
async def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The rollout's gateway on a real Unix socket, its run in the store (temperature 1.0), each signalled
    call answered in process as the workflow's gateway_call activity would."""
    monkeypatch.setenv(GATEWAY_ROOT_ENV, str(tmp_path / "gw"))
    store = RunStore(tmp_path / "home")
    config = {
        "run": {"env": "mini-swe-agent"},
        "sampling": {"temperature": 1.0, "max_tokens": 512, "seed": 7},
    }
    store.register_run(REF.run_id, json.dumps(config), "h")
    engine = ScriptedEngine(["Let me look at the files in this directory first.\n" + CALL, "done"])
    headers = {"Authorization": f"Bearer {gateway_key(RID, 's')}"}
    async with answering_gateway(store, engine, headers) as (http, _, signals):
        yield http, signals, engine, store


async def test_a_temperature_other_than_the_runs_is_a_400_naming_it(served: Any) -> None:
    http, signals, engine, store = served
    for extra, param in [
        ({"temperature": 0.2}, "temperature"),
        ({"n": 2}, "n"),
        ({"top_logprobs": 5}, "top_logprobs"),
    ]:
        async with http.post(URL, json={"model": "m", "messages": MSGS, **extra}) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error" and err["code"]
    assert signals == [] and store.gateway_calls(RID) == [] and engine.prompts == []  # nothing recorded
    async with http.post(URL, json={"model": "m", "messages": MSGS, "temperature": 1.0, "top_p": 1}) as resp:
        assert resp.status == 200  # the run's own values are fine


async def test_stop_and_max_tokens_through_the_gateway(served: Any) -> None:
    http, _, engine, store = served
    body = {"model": "m", "messages": MSGS, "tools": [BASH], "stop": "files", "max_tokens": 40}
    async with http.post(URL, json=body) as resp:
        assert resp.status == 200
        out = await resp.json()
    message = out["choices"][0]["message"]
    assert message["content"] == "Let me look at the " and "tool_calls" not in message  # cut before the call
    assert out["choices"][0]["finish_reason"] == "stop"
    assert engine.asked == [{"max_tokens": 40, "stop": ["files"]}]
    call = store.get_call(RID, 0)
    assert call is not None and call.request["options"] == {"max_tokens": 40, "stop": ["files"]}
    seg = store.get_segment(RID, model_segment(0))
    assert seg is not None and seg.token_ids == engine.returned[0]  # as the engine returned them
    assert engine.tok.decode(seg.token_ids).endswith("files")


async def read_events(resp: aiohttp.ClientResponse, limit: int | None = None) -> list[Any]:
    """The stream's data events (decoded), up to ``limit`` of them."""
    events: list[Any] = []
    while limit is None or len(events) < limit:
        line = await resp.content.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            data = line[len(b"data: ") :].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


async def test_a_broken_stream_retried_yields_the_same_answer(served: Any) -> None:
    http, signals, engine, store = served
    body = {
        "model": "m",
        "messages": MSGS,
        "tools": [BASH],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(URL, json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        first = await read_events(resp, limit=2)  # the role and the first piece of content
        resp.close()  # then the client leaves, mid-answer
    async with http.post(URL, json=body) as resp:  # its client's retry: the same call, from the store
        again = await read_events(resp)
    assert again[: len(first)] == first and again[-1] == "[DONE]"
    chunks = again[:-1]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    async with http.post(URL, json={**body, "stream": False, "stream_options": None}) as resp:
        whole = await resp.json()  # the same call, unstreamed
    assert content == whole["choices"][0]["message"]["content"]
    assert content == "Let me look at the files in this directory first."
    assert chunks == chat.stream_chunks(whole, include_usage=True)
    assert chunks[-1]["usage"] == whole["usage"] and chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert signals == [0] and len(engine.prompts) == 1 and len(store.gateway_calls(RID)) == 1
