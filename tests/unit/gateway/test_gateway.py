"""The gateway's calls as token-exact model turns (gateway/chat.py, gateway/turn.py, store/gateway_calls.py),
with the bundled policy's real tokenizer and chat template and a scripted engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from durable_rollouts.contracts.harness import GatewayCallInput
from durable_rollouts.contracts.types import RolloutRef, SamplingParams, TruncationReason
from durable_rollouts.engines.client import Generation
from durable_rollouts.errors import ContextLengthExceeded
from durable_rollouts.gateway import chat
from durable_rollouts.gateway.server import GatewayServer
from durable_rollouts.gateway.turn import GatewayTurns, sequence_starts
from durable_rollouts.simengine.tokenizer import SimTokenizer
from durable_rollouts.store import RunStore
from durable_rollouts.store.gateway_calls import CallInFlight

MODEL_DIR = Path(__file__).resolve().parents[3] / "engines" / "tiny-policy"
RID = "run/g000000/0"
REF = RolloutRef(
    run_id="run",
    group_id="g000000",
    rollout_id=RID,
    task_id="t1",
    sample_index=0,
    env="mini-swe-agent",
    model="tiny",
)
SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_tokens=512, seed=7, logprob_mode="processed_logprobs"
)
BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}


class ScriptedEngine:
    """Tokenizes like the engine (the policy's template) and samples scripted token ids; a sample asked to
    stop at strings ends at the token that completes the first one, as vLLM's does."""

    def __init__(self, turns: list[list[int] | str], finish: str = "stop", limit: int | None = None) -> None:
        self.tok = SimTokenizer(MODEL_DIR)
        self.turns = turns
        self.finish = finish
        self.limit = limit
        self.prompts: list[list[int]] = []
        self.asked: list[dict[str, Any]] = []
        """What each sample was asked besides its prompt: max_tokens, stop."""
        self.rendered_tools: list[Any] = []
        self.returned: list[list[int]] = []

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text)

    async def tokenize_chat(
        self,
        url: str,
        model: str,
        messages: list[dict[str, str]],
        tools: Any = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        self.rendered_tools.append(tools)
        return self.tok.encode(self.tok.render_chat(messages, add_generation_prompt))

    async def logprob_mode(self, url: str) -> str | None:
        return None  # not told (as vLLM outside dev mode)

    async def detokenize(self, url: str, model: str, token_ids: list[int]) -> str:
        return self.tok.decode(token_ids)

    async def generate(
        self,
        url: str,
        model: str,
        prompt_ids: list[int],
        sampling: Any,
        max_tokens: int,
        rid: str,
        stop: list[str] | None = None,
    ) -> Generation:
        if self.limit is not None and len(prompt_ids) >= self.limit:
            raise ContextLengthExceeded(f"prompt of {len(prompt_ids)} tokens")
        self.prompts.append(list(prompt_ids))
        self.asked.append({"max_tokens": max_tokens, "stop": stop})
        turn = self.turns[len(self.prompts) - 1]
        ids = (self.ids(turn) if isinstance(turn, str) else list(turn)) + [self.tok.eos_id]
        finish = self.finish
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        for n in range(1, len(ids) + 1) if stop else ():
            if any(s in self.tok.decode(ids[:n]) for s in stop or ()):
                ids, finish = ids[:n], "stop"
                break
        lps = [-0.25 - 0.01 * i for i in range(len(ids))]
        self.returned.append(list(ids))
        return Generation(ids, lps, ["v1"] * len(ids), finish, 0.0, 0.0)


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "home")


def call_input(index: int, **kw: Any) -> GatewayCallInput:
    base: dict[str, Any] = dict(
        ref=REF, index=index, engine_url="http://e", sampling=SAMPLING,
        max_tokens=512, max_total_tokens=4096,
    )  # fmt: skip
    return GatewayCallInput(**{**base, **kw})


async def ask(
    store: RunStore, turns: GatewayTurns, messages: list[dict[str, Any]], **kw: Any
) -> dict[str, Any]:
    """One harness request: recorded, answered, read back (what the HTTP side does)."""
    key = chat.request_key(messages, [BASH])
    call = store.open_call(RID, key, {"messages": messages, "tools": [BASH]})
    await turns.answer(call_input(call.index, **kw))
    stored = store.get_call(RID, call.index)
    assert stored is not None and stored.response is not None
    return stored.response


def test_parse_answer_tool_calls_and_plain_text() -> None:
    raw = 'I will look.\n<tool_call>{"name": "bash", "arguments": {"command": "ls -la"}}</tool_call>'
    parsed = chat.parse_answer(raw, 3)
    assert parsed.content == "I will look."
    assert parsed.tool_calls == [
        {
            "id": "call_3_0",
            "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "ls -la"}'},
        }
    ]
    broken = '<tool_call>{"name": "bash", "arguments": </tool_call>'
    assert chat.parse_answer(broken, 0) == chat.Parsed(content=broken, tool_calls=[])
    body = chat.completion(RID, 3, "tiny", parsed, "stop", 10, 5)
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def test_same_request_is_the_same_call_and_one_call_at_a_time(store: RunStore) -> None:
    first = store.open_call(RID, "k1", {"messages": []})
    assert store.open_call(RID, "k1", {"messages": []}).index == first.index == 0
    with pytest.raises(CallInFlight):
        store.open_call(RID, "k2", {"messages": []})
    store.answer_call(RID, 0, 200, {"a": 1}, {})
    assert store.answer_call(RID, 0, 200, {"a": 2}, {}).response == {"a": 1}  # the first answer stands
    assert store.open_call(RID, "k2", {"messages": []}).index == 1


async def test_calls_extend_the_stored_tokens_without_re_tokenizing_samples(store: RunStore) -> None:
    eng = ScriptedEngine([])
    # The model writes the text "<|end|>" byte by byte: the tokenizer would encode it as the special token.
    odd = [b for ch in "<|end|>" for b in eng.ids(ch)]
    assert eng.ids("<|end|>") != odd
    call = '<tool_call>{"name": "bash", "arguments": {"command": "echo hi"}}</tool_call>'
    eng.turns = [odd + eng.ids(call), eng.ids("done")]
    turns = GatewayTurns(store, eng)
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Task id: t1"},
    ]
    first = await ask(store, turns, msgs)
    answer = first["choices"][0]["message"]
    assert answer["content"] == "<|end|>" and answer["tool_calls"][0]["function"]["name"] == "bash"
    # The harness sends its history back as OpenAI clients do (extra keys, other ids), plus a tool result.
    echoed = {**answer, "tool_calls": [{**answer["tool_calls"][0], "id": "other"}], "function_call": None}
    msgs2 = [*msgs, echoed, {"role": "tool", "tool_call_id": "x", "content": "hi"}]
    await ask(store, turns, msgs2)
    segs = store.segments(RID)
    assert [(s.name, s.kind) for s in segs] == [
        ("prompt", "prompt"),
        ("t00000.model", "model"),
        ("c00001.ctx", "observation"),
        ("t00001.model", "model"),
    ]
    sampled = segs[1].token_ids
    assert sampled[: len(odd)] == odd  # stored as sampled
    assert eng.prompts[1] == [
        t for s in segs[:3] for t in s.token_ids
    ]  # the 2nd call extends the 1st exactly
    assert eng.prompts[1][len(eng.prompts[0]) : len(eng.prompts[0]) + len(sampled)] == sampled
    # What the harness added is the template's tokens for the tool message (and nothing sampled).
    assert segs[2].token_ids == eng.ids("<|tool|>hi<|end|><|assistant|>")
    assert segs[1].logprobs is not None and len(segs[1].logprobs) == len(sampled)
    assert segs[2].logprobs is None and segs[2].meta["gateway_call"] == 1


async def test_a_rewritten_history_starts_a_new_sequence(store: RunStore) -> None:
    eng = ScriptedEngine(["one", "two", "three"])
    turns = GatewayTurns(store, eng)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Task id: t1"}]
    a1 = (await ask(store, turns, msgs))["choices"][0]["message"]
    msgs2 = [*msgs, a1, {"role": "user", "content": "more"}]
    a2 = (await ask(store, turns, msgs2))["choices"][0]["message"]
    # The harness summarises: its first exchange is replaced by a summary.
    msgs3 = [{"role": "user", "content": "Task id: t1 (summary: one)"}, a2, {"role": "user", "content": "go"}]
    await ask(store, turns, msgs3)
    ctx = store.get_segment(RID, "c00002.ctx")
    assert ctx is not None and ctx.kind == "context"
    assert ctx.meta["rewrite"]["call"] == 2 and ctx.meta["rewrite"]["at_message"] == 0
    assert ctx.meta["sequence_start"] == ctx.start
    # The third call samples on the new sequence alone: the rewritten conversation, a2 as the model wrote it.
    new = [{"role": "user", "content": "Task id: t1 (summary: one)"}, {"role": "assistant", "content": "two"}]
    rendered = eng.tok.render_chat([*new, {"role": "user", "content": "go"}], True)
    assert eng.prompts[2] == ctx.token_ids == eng.ids(rendered)
    assert sequence_starts(store.segments(RID)) == [{"start": ctx.start, **ctx.meta["rewrite"]}]
    detail = store.get_call(RID, 2)
    assert detail is not None and detail.detail is not None and detail.detail["sequence_start"] == ctx.start


async def test_a_retried_call_is_answered_from_the_store_not_sampled_again(store: RunStore) -> None:
    eng = ScriptedEngine(["x"])
    turns = GatewayTurns(store, eng)
    msgs = [{"role": "user", "content": "hi"}]
    first = await ask(store, turns, msgs)
    again = await turns.answer(call_input(0))
    assert len(eng.prompts) == 1 and again.end == len(store.token_ids(RID))
    assert store.get_call(RID, 0).response == first  # type: ignore[union-attr]


async def test_limits_answer_like_an_openai_server(store: RunStore) -> None:
    eng = ScriptedEngine(["x" * 40])
    turns = GatewayTurns(store, eng)
    out = await ask(store, turns, [{"role": "user", "content": "hi"}], limit=TruncationReason.MAX_TURNS)
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["message"]["content"] is None
    assert eng.prompts == [] and store.get_call(RID, 0).detail["limit"] == "max_turns"  # type: ignore[union-attr]


async def test_token_budget_cuts_the_sample_and_context_length_is_a_400(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "a")
    eng = ScriptedEngine(["x" * 40])
    turns = GatewayTurns(store, eng)
    await ask(store, turns, [{"role": "user", "content": "hi"}], max_total_tokens=12)
    res = await turns.answer(call_input(0, max_total_tokens=12))
    assert res.finish_reason == "length" and res.end == 12
    store2 = RunStore(tmp_path / "b")
    turns2 = GatewayTurns(store2, ScriptedEngine(["x"], limit=3))
    key = chat.request_key([{"role": "user", "content": "hi"}], None)
    store2.open_call(RID, key, {"messages": [{"role": "user", "content": "hi"}], "tools": None})
    res2 = await turns2.answer(call_input(0))
    call = store2.get_call(RID, 0)
    assert (
        call is not None and call.status == 400 and res2.truncated_reason == TruncationReason.CONTEXT_LENGTH
    )
    assert json.dumps(call.response).count("context_length_exceeded") == 1


@contextlib.asynccontextmanager
async def answering_gateway(
    store: RunStore, engine: Any, headers: dict[str, str] | None = None
) -> AsyncIterator[tuple[aiohttp.ClientSession, str, list[int]]]:
    """Rollout RID's gateway on a real Unix socket, each signalled call answered in process as the
    workflow's gateway_call activity would: (a client session on the socket, its path, the call indexes
    signalled). The server is closed on the way out."""
    server = GatewayServer(store, secret="s")
    turns = GatewayTurns(store, engine)
    signals: list[int] = []
    running: set[asyncio.Task[None]] = set()

    async def signal(rollout_id: str, index: int) -> None:
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
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path), headers=headers) as http:
            yield http, path, signals
    finally:
        await server.aclose()
