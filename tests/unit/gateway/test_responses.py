"""The Responses API (gateway/responses.py, gateway/response_items.py): a request as Codex CLI sends it
converted to the chat call it is recorded as, the answer read back as output items that, sent back as the
next input, extend the stored tokens; the stream a pure function of the stored answer; fields refused with
a 400 naming them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from durable_rollouts.gateway import chat, response_items, responses
from durable_rollouts.gateway.options import BadChatRequest, RunSampling
from durable_rollouts.gateway.turn import GatewayTurns
from durable_rollouts.store import RunStore
from tests.unit.gateway.test_gateway import RID, ScriptedEngine, call_input

RUN = RunSampling(temperature=1.0, top_p=1.0, top_k=-1, min_tokens=0)
EXEC = {
    "type": "function", "name": "exec_command", "description": "Runs a command.", "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}  # fmt: skip
PATCH = {
    "type": "custom", "name": "apply_patch", "description": "Edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}  # fmt: skip
CODEX_FIELDS: dict[str, Any] = {
    "model": "tiny", "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "0a1b", "client_metadata": {"session_id": "0a1b"},
}  # fmt: skip
"""The fields besides input and tools that Codex CLI 0.169.0 sends with every request."""


def codex_input(task: str = "Task id: t1") -> list[dict[str, Any]]:
    return [
        {"type": "message", "id": "msg_a", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent."}]},
        {"type": "message", "id": "msg_b", "role": "user", "content": [{"type": "input_text", "text": task}]},
    ]  # fmt: skip


def body(items: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {**CODEX_FIELDS, "input": items, "tools": [EXEC, PATCH], **kw}


def refused(**kw: Any) -> BadChatRequest:
    with pytest.raises(BadChatRequest) as info:
        responses.request_call(body(codex_input(), **kw), RUN)
    return info.value


def test_a_codex_request_is_a_chat_call() -> None:
    call = responses.request_call(body(codex_input(), instructions="Be brief."), RUN)
    assert call.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Task id: t1"},
    ]
    assert call.tools is not None and [t["function"]["name"] for t in call.tools] == [
        "exec_command",
        "apply_patch",
    ]
    assert call.tools[0]["function"]["parameters"] == EXEC["parameters"]
    patch = call.tools[1]["function"]
    assert patch["parameters"]["required"] == ["input"] and 'start: "*** Begin Patch"' in patch["description"]
    assert call.custom_tools == ("apply_patch",) and call.options.stream
    assert call.recorded()["api"] == "responses" and call.recorded()["custom_tools"] == ["apply_patch"]
    # The same request is the same call; another conversation, or the same one on the chat API, is not.
    assert responses.request_call(body(codex_input(), instructions="Be brief."), RUN).key() == call.key()
    assert responses.request_call(body(codex_input("other")), RUN).key() != call.key()
    assert call.key() != chat.request_key(call.messages, call.tools, call.options)
    assert responses.request_call({"input": "hi"}, RUN).messages == [{"role": "user", "content": "hi"}]


def test_fields_are_honoured_or_refused_naming_them() -> None:
    e = refused(temperature=0.5)
    assert e.param == "temperature" and "0.5" in str(e) and e.code == "unsupported_value"
    assert refused(max_output_tokens=0).param == "max_output_tokens"
    call = responses.request_call(body(codex_input(), max_output_tokens=64, temperature=1.0), RUN)
    assert call.options.max_tokens == 64 and call.options.recorded() == {"max_tokens": 64}
    assert refused(previous_response_id="resp_1").param == "previous_response_id"
    assert refused(tools=[EXEC, {"type": "web_search"}]).param == "tools"
    assert refused(include=["message.output_text.logprobs"]).param == "include"
    assert refused(reasoning={"effort": "high"}).param == "reasoning"
    assert refused(text={"format": {"type": "json_object"}}).param == "text"
    assert refused(truncation="auto").param == "truncation"
    assert refused(frobnicate=1).param == "frobnicate"
    assert refused(tool_choice="required").param == "tool_choice"
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}
    with pytest.raises(BadChatRequest, match=r"input\[2\]"):
        responses.request_call(body([*codex_input(), image]), RUN)


def test_output_items_sent_back_are_the_answer_given() -> None:
    message = {
        "role": "assistant", "content": "Looking.", "reasoning_content": "I should list files.",
        "tool_calls": [
            {"id": "call_0_0", "type": "function",
             "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'}},
            {"id": "call_0_1", "type": "function",
             "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin Patch"}'}},
        ],
    }  # fmt: skip
    items = response_items.output_items(message, RID, 0, {"apply_patch"})
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "custom_tool_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "I should list files."}]
    assert items[2]["call_id"] == "call_0_0" and items[2]["arguments"] == '{"cmd": "ls"}'
    assert items[3]["input"] == "*** Begin Patch" and items[3]["call_id"] == "call_0_1"
    assert response_items.output_items(message, RID, 0, {"apply_patch"}) == items  # ids are stable
    outputs = [
        {"type": "function_call_output", "call_id": "call_0_0", "output": "a.txt"},
        {"type": "custom_tool_call_output", "call_id": "call_0_1",
         "output": [{"type": "input_text", "text": "ok"}]},
    ]  # fmt: skip
    call = responses.request_call(body([*codex_input(), *items, *outputs]), RUN)
    answer, tool_a, tool_b = call.messages[2:]
    assert chat.same_answer(answer, message) and answer["reasoning_content"] == "I should list files."
    assert tool_a == {"role": "tool", "tool_call_id": "call_0_0", "content": "a.txt"}
    assert tool_b["content"] == "ok"
    # Two answers in a row (a text answer, then the next one's reasoning) stay two assistant messages.
    two = responses.request_call(body([*codex_input(), items[1], items[0], items[2]]), RUN).messages[2:]
    assert [m.get("reasoning_content") for m in two] == [None, "I should list files."]
    assert two[0]["content"] == "Looking." and "tool_calls" in two[1]


def test_the_stream_is_a_function_of_the_stored_answer() -> None:
    message = {"role": "assistant", "content": "x" * 40, "reasoning_content": "think"}
    completion = chat.completion(RID, 2, "tiny", chat.Parsed("x" * 40, [], "think"), "stop", 10, 5)
    completion["choices"][0]["message"] = message
    resp = response_items.response_object(completion, RID, 2, set())
    events = response_items.stream_events(resp)
    assert events == response_items.stream_events(response_items.response_object(completion, RID, 2, set()))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "x" * 40 and kinds.count("response.output_text.delta") == 3
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "think"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == resp["output"] and events[-1]["response"] == resp
    assert resp["usage"]["input_tokens"] == 10 and resp["usage"]["output_tokens"] == 5
    assert response_items.sse(events[0]).startswith(b"event: response.created\ndata: {")
    cut = chat.completion(RID, 3, "tiny", chat.Parsed("xx", []), "length", 10, 2)
    short = response_items.response_object(cut, RID, 3, set())
    assert short["status"] == "incomplete" and short["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response_items.stream_events(short)[-1]["type"] == "response.incomplete"


async def ask(store: RunStore, turns: GatewayTurns, items: list[dict[str, Any]]) -> dict[str, Any]:
    """One Responses request as the server records and answers it; the response it is given."""
    call = responses.request_call(body(items), RUN)
    opened = store.open_call(RID, call.key(), call.recorded())
    await turns.answer(call_input(opened.index))
    stored = store.get_call(RID, opened.index)
    assert stored is not None and stored.response is not None and stored.status == 200
    return response_items.response_object(stored.response, RID, stored.index, set(call.custom_tools))


async def test_a_codex_episode_extends_the_stored_tokens(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "home")
    patch = '<tool_call>{"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}</tool_call>'
    run = '<tool_call>{"name": "exec_command", "arguments": {"cmd": "ls"}}</tool_call>'
    eng = ScriptedEngine([patch, "Checking." + run, "done"])
    turns = GatewayTurns(store, eng)
    items = codex_input()
    first = await ask(store, turns, items)
    assert [o["type"] for o in first["output"]] == ["custom_tool_call"]
    assert first["output"][0]["input"] == "*** Begin Patch" and first["output"][0]["name"] == "apply_patch"
    # Codex sends the whole history back: its items as given (its own ids), then the tool's output.
    echoed = [{**o, "id": "ctc_local"} for o in first["output"]]
    items += [
        *echoed,
        {"type": "custom_tool_call_output", "call_id": echoed[0]["call_id"], "output": "Done!"},
    ]
    second = await ask(store, turns, items)
    assert [o["type"] for o in second["output"]] == ["message", "function_call"]
    assert second["output"][0]["content"][0]["text"] == "Checking."
    items += [*second["output"], {"type": "function_call_output", "call_id": second["output"][1]["call_id"],
                                  "output": "a.txt"}]  # fmt: skip
    third = await ask(store, turns, items)
    assert third["output"][0]["content"][0]["text"] == "done" and third["status"] == "completed"
    segs = store.segments(RID)
    assert [s.kind for s in segs] == ["prompt", "model", "observation", "model", "observation", "model"]
    for k in (1, 2):  # each call's prompt is the stored tokens exactly: the samples stand as sampled
        assert eng.prompts[k] == [t for s in segs[: 2 * k + 1] for t in s.token_ids]
    assert [s.token_ids for s in segs if s.kind == "model"] == eng.returned
    assert len(eng.prompts) == 3 and len(store.gateway_calls(RID)) == 3
    # The tool's output is rendered as a tool message by the template, and the tools were offered.
    assert segs[2].token_ids == eng.ids("<|tool|>Done!<|end|><|assistant|>")
    assert all(json.dumps(t).count("apply_patch") == 1 for t in eng.rendered_tools if t)


def test_the_docs_table_names_every_field_served() -> None:
    from tests import REPO_ROOT

    text = (REPO_ROOT / "docs" / "harness.md").read_text()
    section = text.split("## The Responses API", 1)[1].split("\n## ", 1)[0]
    table = section.split("| field |", 1)[1]
    named = {
        name
        for line in table.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`([a-z_]+)`", line.split("|")[1])
    }
    served = (
        responses._HANDLED | set(responses._CHAT_FIELDS) | set(responses.IGNORED) | set(responses._REFUSED)
    )
    assert named == served
