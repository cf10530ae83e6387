"""The simulated engine, driven by the project's own EngineClient over HTTP on a free port.

Token ids are checked against the HF tokenizer of the bundled policy (what real vLLM uses), scripted turns
against the tool-call parser, errors against the client's classification, /metrics against its parser.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from durable_rollouts.contracts.types import SamplingParams
from durable_rollouts.engines.client import EngineClient, Generation
from durable_rollouts.engines.metrics import parse_metrics
from durable_rollouts.environments.tool_calls import ToolCall, ToolCallError, parse_tool_call
from durable_rollouts.errors import ContextLengthExceeded, EngineBadRequest, EngineUnavailable
from durable_rollouts.simengine import SCRIPTED_LOGPROB, Mode, ModeRule, PolicyName, SimEngine, SimSettings
from durable_rollouts.simengine.scheduler import PrefixCache, Scheduler
from durable_rollouts.simengine.scripts import load_scripted_tasks
from tests import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

MODEL_DIR = REPO_ROOT / "engines" / "tiny-policy"
TASKS = REPO_ROOT / "environments" / "coding" / "coding_env" / "data" / "coding.jsonl"
SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_tokens=2048, seed=None, logprob_mode="processed_logprobs"
)
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Task id: code-fizzbuzz\nImplement fizzbuzz."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "héllo wörld ✓ 日本"},
        {"role": "assistant", "content": '<tool_call>{"name": "submit"}</tool_call>'},
        {"role": "tool", "content": "exit code 0\n  two  spaces\t<|end|> marker"},
    ],
    [{"role": "user", "content": ""}],
]

Served = tuple[SimEngine, str, EngineClient]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Served]]]:
    """Start engines on free ports with the given settings; all stop when the test ends."""
    stack: list[Any] = []

    async def start(**overrides: Any) -> Served:
        engine = SimEngine(SimSettings(**{"tasks": TASKS, **overrides}))
        cm = engine.serve(port=0)
        url = await cm.__aenter__()
        client = EngineClient(timeout_s=20)
        stack.append((cm, client))
        return engine, url, client

    yield start
    for cm, client in reversed(stack):
        await client.aclose()
        await cm.__aexit__(None, None, None)


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


async def _gen(
    client: EngineClient, url: str, ids: list[int], request_id: str = "r/g/0/0/1", **kw: Any
) -> Generation:
    sampling = SAMPLING.model_copy(update=kw)
    return await client.generate(url, "tiny", ids, sampling, sampling.max_tokens, request_id)


async def _episode(
    client: EngineClient, url: str, task_id: str, turns: int, request_id: str = "run/g0/0"
) -> list[ToolCall | ToolCallError]:
    """Play ``turns`` turns as a harness would: generate, parse, append an observation, repeat."""
    prompt = await client.tokenize_chat(
        url, "tiny", [{"role": "user", "content": f"Task id: {task_id}\nSolve."}]
    )
    context, parsed = list(prompt), []
    for turn in range(turns):
        gen = await _gen(client, url, context, f"{request_id}/{turn}/1")
        assert gen.finish_reason == "stop" and gen.token_ids[-1] == 258
        assert gen.logprobs == [SCRIPTED_LOGPROB] * len(gen.token_ids)
        text = await client.detokenize(url, "tiny", gen.token_ids)
        assert text.endswith("<|end|>")
        parsed.append(parse_tool_call(text.removesuffix("<|end|>")))
        obs = await client.tokenize_text(url, "tiny", "<|tool|>ok<|end|><|assistant|>")
        context += gen.token_ids + obs
    return parsed


def _write(call: ToolCall | ToolCallError) -> str:
    assert isinstance(call, ToolCall) and call.name == "write_file", call
    assert call.arguments["path"] == "solution.py"
    return call.arguments["content"]


async def test_tokenize_matches_hf_tokenizer(
    serve: Callable[..., Awaitable[Served]], hf_tokenizer: Any
) -> None:
    _, url, client = await serve()
    for messages in CONVERSATIONS:
        ours = await client.tokenize_chat(url, "tiny", messages)
        hf = hf_tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert ours == list(hf)
        text = messages[-1]["content"]
        assert await client.tokenize_text(url, "tiny", text) == hf_tokenizer.encode(
            text, add_special_tokens=False
        )
        assert await client.detokenize(url, "tiny", ours) == hf_tokenizer.decode(ours)
    async with httpx.AsyncClient() as http:
        body = {"model": "tiny", "messages": CONVERSATIONS[0], "add_generation_prompt": False}
        reply = (await http.post(f"{url}/tokenize", json=body)).json()
    assert (
        reply["tokens"][-1] == 258
        and reply["count"] == len(reply["tokens"])
        and reply["max_model_len"] == 4096
    )
    assert await client.max_model_len(url, "tiny") == 4096
    # Recorded from vLLM 0.32: /detokenize keeps special tokens; invalid UTF-8 becomes U+FFFD.
    assert await client.detokenize(url, "tiny", [104, 105, 258, 261, 255]) == "hi<|end|><|assistant|>\ufffd"


async def test_scripted_reference_writes_the_solution_then_submits(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    _, url, client = await serve()
    task = load_scripted_tasks(TASKS)[0]
    first, second, third = await _episode(client, url, task.id, 3)
    assert _write(first) == task.reference["solution.py"]
    assert second == ToolCall(name="submit", arguments={}) == third


async def test_modes_by_rule_setting_and_endpoint(serve: Callable[..., Awaitable[Served]]) -> None:
    rules = [ModeRule.parse("request:bad/=malformed"), ModeRule.parse("task:code-roman=wrong")]
    engine, url, client = await serve(mode_rules=rules)
    tasks = {t.id: t for t in load_scripted_tasks(TASKS)}
    calls = await _episode(client, url, "code-fizzbuzz", 5, request_id="bad/g0/0")
    assert [isinstance(c, ToolCallError) for c in calls] == [True, True, True, False, False]
    assert "not valid JSON" in calls[0].message and "unknown tool 'rm'" in calls[1].message  # type: ignore[union-attr]
    assert "missing argument 'content'" in calls[2].message  # type: ignore[union-attr]
    assert _write(calls[3]) == tasks["code-fizzbuzz"].reference["solution.py"]
    assert (
        _write((await _episode(client, url, "code-roman", 1))[0]) == tasks["code-roman"].wrong["solution.py"]
    )
    engine.settings.mode = Mode.LOOP
    loop = await _episode(client, url, "code-fizzbuzz", 4)
    assert loop == [ToolCall(name="bash", arguments={"cmd": "echo step"})] * 4
    async with httpx.AsyncClient() as http:
        reply = await http.post(f"{url}/mode", json={"mode": "sleep", "rules": []})
        assert reply.json() == {"mode": "sleep", "rules": []}
        assert (await http.post(f"{url}/mode", json={"mode": "nope"})).status_code == 400
    assert await _episode(client, url, "code-roman", 1) == [
        ToolCall(name="bash", arguments={"cmd": "sleep 30"})
    ]


async def test_requests_the_scripted_policy_cannot_serve_are_bad_requests(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    _, url, client = await serve()
    no_task = await client.tokenize_chat(url, "tiny", [{"role": "user", "content": "hello"}])
    with pytest.raises(EngineBadRequest, match="Task id"):
        await _gen(client, url, no_task)
    unknown = await client.tokenize_chat(url, "tiny", [{"role": "user", "content": "Task id: code-nope"}])
    with pytest.raises(EngineBadRequest, match="unknown task id 'code-nope'"):
        await _gen(client, url, unknown)
    with pytest.raises(EngineBadRequest, match="does not exist"):
        await client.tokenize_text(url, "other-model", "x")
    with pytest.raises(EngineBadRequest, match="out of vocabulary"):
        await _gen(client, url, [1, 999])


async def test_context_length_and_max_tokens(serve: Callable[..., Awaitable[Served]]) -> None:
    engine, url, client = await serve()
    prompt = await client.tokenize_chat(url, "tiny", CONVERSATIONS[0])
    gen = await _gen(client, url, prompt, max_tokens=5)
    assert (gen.finish_reason, len(gen.token_ids)) == ("length", 5)
    assert await client.max_model_len(url, "tiny") == 4096  # cached by the client from now on
    engine.settings.max_model_len = len(prompt) + 7
    gen = await _gen(client, url, prompt)
    assert (gen.finish_reason, len(gen.token_ids)) == ("length", 7)
    engine.settings.max_model_len = len(prompt) - 1
    with pytest.raises(ContextLengthExceeded, match="longer than the maximum model length"):
        await _gen(client, url, prompt)


async def test_generate_reply_has_vllm_shape(serve: Callable[..., Awaitable[Served]]) -> None:
    _, url, client = await serve()
    prompt = await client.tokenize_chat(url, "tiny", CONVERSATIONS[0])
    body = {
        "model": "tiny",
        "request_id": "abc",
        "token_ids": prompt,
        "sampling_params": {"temperature": 1.0, "max_tokens": 3, "logprobs": 0, "detokenize": False},
        "output_mode": "tokens",
    }
    async with httpx.AsyncClient() as http:
        reply = (await http.post(f"{url}/inference/v1/generate", json=body)).json()
        wrong_model = await http.post(f"{url}/inference/v1/generate", json={**body, "model": "nope"})
        extra = {**body, "sampling_params": {**body["sampling_params"], "n": 2}}
        drift = await http.post(f"{url}/inference/v1/generate", json=extra)
    assert reply["request_id"] == "generate-tokens-abc" and reply["usage"]["completion_tokens"] == 3
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "length" and choice["weight_versions"] == [
        {"version": "v0", "start": 0, "end": 3}
    ]
    first = choice["logprobs"]["content"][0]
    assert (
        first["token_id"] == choice["token_ids"][0] and first["rank"] == 1 and len(first["top_logprobs"]) == 1
    )
    assert wrong_model.status_code == 404
    assert wrong_model.json()["error"] == {
        "message": "The model `nope` does not exist. Valid aliases: tiny.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert drift.status_code == 400 and "sampling_params.n" in drift.json()["error"]["message"]


async def test_injected_503_and_dropped_connections_are_retryable(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    engine, url, client = await serve(policy=PolicyName.RANDOM, tasks=None)
    async with httpx.AsyncClient() as http:
        assert (await http.post(f"{url}/fault", json={"fail_next": 2})).json()["fail_next"] == 2
        for _ in range(2):
            with pytest.raises(EngineUnavailable, match="HTTP 503"):
                await _gen(client, url, [1, 2, 3])
        await _gen(client, url, [1, 2, 3])
        await http.post(f"{url}/fault", json={"drop_next": 1})
        with pytest.raises(EngineUnavailable, match="RemoteProtocolError"):
            await _gen(client, url, [1, 2, 3])
        await _gen(client, url, [1, 2, 3])
        assert (await http.post(f"{url}/fault", json={"fail_next": -1})).status_code == 400
        await http.post(f"{url}/fault", json={"unhealthy": True})
        assert (await http.get(f"{url}/health")).status_code == 503
    assert engine.faults.snapshot()["fail_next"] == 0


async def _until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not cond():
            await asyncio.sleep(0.005)


async def test_hang_holds_generates_while_health_stays_up(serve: Callable[..., Awaitable[Served]]) -> None:
    engine, url, client = await serve(policy=PolicyName.RANDOM, tasks=None, max_num_seqs=1)
    async with httpx.AsyncClient() as http:
        await http.post(f"{url}/fault", json={"hang": True})
        calls = [asyncio.create_task(_gen(client, url, [7, 8, 9], f"r/{i}")) for i in range(2)]
        await _until(lambda: engine.scheduler.running == 1 and engine.scheduler.waiting == 1)
        assert (await http.get(f"{url}/health")).status_code == 200
        reading = parse_metrics((await http.get(f"{url}/metrics")).text, url=url, engine_id="e0", at=0.0)
        assert (reading.running, reading.waiting_capacity) == (1, 1)
        assert not any(c.done() for c in calls)
        await http.post(f"{url}/fault", json={"hang": False})
        for gen in await asyncio.gather(*calls):
            assert gen.token_ids[-1] == 258 or gen.finish_reason == "length"


async def test_weight_version_spans(serve: Callable[..., Awaitable[Served]]) -> None:
    engine, url, client = await serve(decode_ms_per_token=10)
    prompt = await client.tokenize_chat(url, "tiny", CONVERSATIONS[0])
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{url}/weight_info")).json() == {"weight_version": "v0"}
        call = asyncio.create_task(_gen(client, url, prompt, max_tokens=64))
        await _until(lambda: engine.scheduler.running == 1)
        reply = await http.post(f"{url}/update_weight_version", json={"new_version": "v1"})
        assert reply.json() == {"success": True, "new_version": "v1"}
        assert (await http.get(f"{url}/weight_info")).json() == {"weight_version": "v1"}
    gen = await call
    k = gen.policy_versions.index("v1")
    assert 0 < k < 64 and k % 16 == 0
    assert gen.policy_versions == ["v0"] * k + ["v1"] * (64 - k)
    engine.settings.decode_ms_per_token = 0
    assert set((await _gen(client, url, prompt)).policy_versions) == {"v1"}


async def test_metrics_parse_and_count(serve: Callable[..., Awaitable[Served]]) -> None:
    _, url, client = await serve(policy=PolicyName.RANDOM, tasks=None, num_gpu_blocks=100, block_size=8)
    for _ in range(2):
        await _gen(client, url, list(range(40)), seed=3)
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics")).text
    reading = parse_metrics(text, url=url, engine_id="e0", at=1.0)
    assert reading.kv_capacity_tokens == 800 and reading.running == 0 and reading.kv_usage == 0.0
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 80.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 40.0' in text
    assert 'vllm:num_preemptions_total{engine="0",model_name="tiny"} 0.0' in text


async def test_random_policy_is_reproducible_when_seeded(serve: Callable[..., Awaitable[Served]]) -> None:
    _, url, client = await serve(policy=PolicyName.RANDOM, tasks=None)
    a = await _gen(client, url, [1, 2, 3], seed=7)
    b = await _gen(client, url, [1, 2, 3], seed=7)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids[-1] == 258 and all(t < 256 for t in a.token_ids[:-1])
    assert all(-7 < lp < -5 for lp in a.logprobs)
    assert (await _gen(client, url, [1, 2, 4], seed=7)).token_ids != a.token_ids


async def test_scheduler_is_fifo_under_kv_budget() -> None:
    sched = Scheduler(max_num_seqs=4, kv_capacity_tokens=100)
    order: list[str] = []

    async def run(name: str, tokens: int, release: asyncio.Event) -> None:
        async with sched.admit(tokens):
            order.append(name)
            await release.wait()

    gates = {n: asyncio.Event() for n in "abc"}
    tasks = [asyncio.create_task(run(n, t, gates[n])) for n, t in (("a", 60), ("b", 60), ("c", 10))]
    await _until(lambda: order == ["a"] and sched.waiting == 2)
    gates["a"].set()
    await _until(lambda: order == ["a", "b", "c"])
    assert sched.running == 2 and sched.kv_used == 70
    for g in gates.values():
        g.set()
    await asyncio.gather(*tasks)
    assert (sched.running, sched.kv_used, sched.waiting) == (0, 0, 0)


def test_prefix_cache_counts_leading_full_blocks() -> None:
    cache = PrefixCache(block_size=4, capacity_blocks=3)
    assert cache.lookup(list(range(10))) == 0
    assert cache.lookup(list(range(10))) == 8
    assert cache.lookup([0, 1, 2, 3, 9, 9, 9, 9]) == 4
    assert (cache.queries_total, cache.hits_total) == (28, 12)


def test_cli_serves_until_sigterm(tmp_path: Any) -> None:
    argv = [
        sys.executable,
        "-m",
        "durable_rollouts.simengine",
        "--port",
        "0",
        "--tasks",
        str(TASKS),
        "--mode",
        "wrong",
    ]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("simengine ready on http://127.0.0.1:"), line
            url = line.split()[3]
            assert httpx.get(f"{url}/health").status_code == 200
            entry = httpx.get(f"{url}/v1/models").json()["data"][0]
            assert (entry["id"], entry["max_model_len"]) == ("tiny", 4096)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    done = subprocess.run(
        [*argv[:5], "--tasks", str(bad)], capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "bad.jsonl:1: field" in done.stderr
