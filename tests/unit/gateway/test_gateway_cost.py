"""One chat-template render per gateway call (gateway/turn.py, `Renders`): where the render proves itself an
extension of the previous call's render, the previous answer's sampled tokens and its closing, the call
stores exactly what the two-render check stores; anything else falls back to the two-render check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from durable_rollouts.gateway.turn import GatewayTurns, Renders
from durable_rollouts.store import RunStore
from tests.unit.gateway.test_gateway import RID, ScriptedEngine, ask


class CountingEngine(ScriptedEngine):
    """The scripted engine, counting renders: whole conversations with the generation prompt (``full``)
    and closed ones (``closed``, the two-render check's second render and the closing probe)."""

    def __init__(self, turns: list[list[int] | str]) -> None:
        super().__init__(turns)
        self.renders = {"full": 0, "closed": 0}

    async def tokenize_chat(
        self, url: str, model: str, messages: list[dict[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:  # fmt: skip
        self.renders["full" if add_generation_prompt else "closed"] += 1
        return await super().tokenize_chat(url, model, messages, tools, add_generation_prompt)


class OldTurnsShown(CountingEngine):
    """A template that renders earlier answers otherwise than the last one (as templates that drop an
    earlier turn's reasoning do): not append-only across calls."""

    async def tokenize_chat(
        self, url: str, model: str, messages: list[dict[str, Any]], tools: Any = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:  # fmt: skip
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        shown = [
            {**m, "content": "(earlier) " + m["content"]} if m["role"] == "assistant" and i < last else m
            for i, m in enumerate(messages)
        ]
        return await super().tokenize_chat(url, model, shown, tools, add_generation_prompt)


async def converse(store: RunStore, turns: GatewayTurns, n: int) -> None:
    """``n`` calls of one conversation: each answer sent back, then an observation."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Task id: t1"},
    ]
    for i in range(n):
        answer = (await ask(store, turns, msgs))["choices"][0]["message"]
        msgs += [answer, {"role": "user", "content": f"observation {i}"}]


def stored(store: RunStore) -> list[tuple[str, str, list[int], Any]]:
    return [(s.name, s.kind, s.token_ids, s.meta.get("rewrite")) for s in store.segments(RID)]


TEXT = ['<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>', "I see.", "done"] * 2


async def test_each_call_renders_once_and_stores_what_two_renders_store(tmp_path: Path) -> None:
    one, two = CountingEngine(TEXT), CountingEngine(TEXT)
    fast, slow = RunStore(tmp_path / "a"), RunStore(tmp_path / "b")
    await converse(fast, GatewayTurns(fast, one), 6)
    checked_twice = GatewayTurns(slow, two)
    checked_twice.renders = Renders(size=0)  # no render kept: every call renders the old conversation too
    await converse(slow, checked_twice, 6)
    assert stored(fast) == stored(slow)
    assert [s.kind for s in fast.segments(RID)][2::2] == ["observation"] * 5  # every call extended
    assert one.prompts == two.prompts
    assert one.renders == {"full": 6, "closed": 2}  # one render a call (and the closing probe's two, once)
    assert two.renders == {"full": 6, "closed": 2 + 5}


async def test_a_non_canonical_sample_or_another_workers_call_is_checked_with_two_renders(
    tmp_path: Path,
) -> None:
    eng = CountingEngine([])
    odd = [b for ch in "<|end|>" for b in eng.ids(ch)]  # "<|end|>" written byte by byte: not how it encodes
    eng.turns = [odd, "fine", "fine"]
    store = RunStore(tmp_path / "a")
    await converse(store, GatewayTurns(store, eng), 2)
    assert eng.renders == {"full": 2, "closed": 2 + 1}  # the render does not hold the sampled tokens
    second = RunStore(tmp_path / "b")
    eng2 = CountingEngine(["a", "b"])
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Task id: t1"}]
    answer = (await ask(second, GatewayTurns(second, eng2), msgs))["choices"][0]["message"]
    eng2.renders = {"full": 0, "closed": 0}
    await ask(second, GatewayTurns(second, eng2), [*msgs, answer, {"role": "user", "content": "more"}])
    assert eng2.renders == {"full": 1, "closed": 2 + 1}  # a worker that did not render call 0 renders it
    ctx = second.get_segment(RID, "c00001.ctx")
    assert ctx is not None and ctx.kind == "observation"


async def test_a_template_that_changes_earlier_turns_is_checked_with_two_renders(tmp_path: Path) -> None:
    one, two = OldTurnsShown(["one", "two", "three"]), OldTurnsShown(["one", "two", "three"])
    fast, slow = RunStore(tmp_path / "a"), RunStore(tmp_path / "b")
    await converse(fast, GatewayTurns(fast, one), 3)
    checked_twice = GatewayTurns(slow, two)
    checked_twice.renders = Renders(size=0)
    await converse(slow, checked_twice, 3)
    assert stored(fast) == stored(slow) and one.prompts == two.prompts  # what the two-render check decides
    # Call 1's render extends call 0's; call 2's renders answer 0 otherwise than call 1's did: checked twice.
    assert one.renders == {"full": 3, "closed": 2 + 1}
