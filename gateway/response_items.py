"""A stored chat answer as a Responses API ``response`` object and its server-sent events (pure).

Invariants:
- A function of the stored answer (the ``chat.completion`` the call stored) and the custom tools the call
  recorded: every id is derived from the rollout and the call index, so an answer read twice (a client's
  retry, a stream broken and asked again) is the same response and the same events.
- Output items in one order: ``reasoning`` (where the run's format reads it; its text as
  ``reasoning_text`` content, nothing encrypted), ``message`` (``output_text``), then one
  ``function_call`` or ``custom_tool_call`` per tool call, in the order the model wrote them (the order
  ``gateway.responses`` reads them back in).
- A ``length`` finish is a response ``incomplete`` (``max_output_tokens``), as OpenAI's servers answer.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from durable_rollouts.gateway.chat import STREAM_CHARS
from durable_rollouts.gateway.responses import CUSTOM_ARG


def _ident(prefix: str, rollout_id: str, index: int, k: int | None = None) -> str:
    tail = "" if k is None else f"/{k}"
    return f"{prefix}_{hashlib.sha256(f'{rollout_id}/{index}{tail}'.encode()).hexdigest()[:32]}"


def output_items(
    message: dict[str, Any], rollout_id: str, index: int, custom: set[str]
) -> list[dict[str, Any]]:
    """The output items of an answered message (see the module's invariants)."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append({
            "type": "reasoning", "id": _ident("rs", rollout_id, index), "summary": [],
            "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}],
            "encrypted_content": None, "status": "completed",
        })  # fmt: skip
    if message.get("content"):
        items.append({
            "type": "message", "id": _ident("msg", rollout_id, index), "role": "assistant",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}
            ],
        })  # fmt: skip
    for k, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        name, args = fn.get("name"), fn.get("arguments", "")
        item_id = _ident("fc", rollout_id, index, k)
        if name in custom:
            items.append({
                "type": "custom_tool_call", "id": item_id, "call_id": call["id"], "name": name,
                "input": _custom_input(args), "status": "completed",
            })  # fmt: skip
        else:
            items.append({
                "type": "function_call", "id": item_id, "call_id": call["id"], "name": name,
                "arguments": args, "status": "completed",
            })  # fmt: skip
    return items


def _custom_input(arguments: str) -> str:
    """A custom tool's input: the ``input`` argument the model wrote, else its arguments verbatim."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(parsed, dict) and set(parsed) == {CUSTOM_ARG} and isinstance(parsed[CUSTOM_ARG], str):
        return str(parsed[CUSTOM_ARG])
    return arguments


def response_object(
    completion: dict[str, Any], rollout_id: str, index: int, custom: set[str]
) -> dict[str, Any]:
    """The ``response`` of a stored ``chat.completion`` (see the module's invariants)."""
    choice = completion["choices"][0]
    usage = completion.get("usage") or {}
    length = choice.get("finish_reason") == "length"
    return {
        "id": _ident("resp", rollout_id, index),
        "object": "response",
        "created_at": completion.get("created", 0),
        "status": "incomplete" if length else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if length else None,
        "error": None,
        "model": completion.get("model", ""),
        "output": output_items(choice["message"], rollout_id, index, custom),
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "store": False,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0),
        },
    }


def stream_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A ``response`` as the events of its stream (pure: the same response gives the same events):
    ``response.created``, ``response.in_progress``, each output item added, its text in deltas of
    `gateway.chat.STREAM_CHARS` characters and done, then ``response.completed`` (or
    ``response.incomplete``) with the whole response. Each event has its ``sequence_number``."""
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    opening = {**response, "status": "in_progress", "output": [], "incomplete_details": None, "usage": None}
    emit("response.created", response=opening)
    emit("response.in_progress", response=opening)
    for i, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": i}
        kind = item["type"]
        if kind == "message":
            emit(
                "response.output_item.added",
                output_index=i,
                item={**item, "status": "in_progress", "content": []},
            )
            part = item["content"][0]
            emit("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
            for piece in _pieces(part["text"]):
                emit("response.output_text.delta", **at, content_index=0, delta=piece, logprobs=[])
            emit("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            emit("response.content_part.done", **at, content_index=0, part=part)
        elif kind == "reasoning":
            emit(
                "response.output_item.added",
                output_index=i,
                item={**item, "status": "in_progress", "content": []},
            )
            text = item["content"][0]["text"]
            for piece in _pieces(text):
                emit("response.reasoning_text.delta", **at, content_index=0, delta=piece)
            emit("response.reasoning_text.done", **at, content_index=0, text=text)
        elif kind == "function_call":
            emit("response.output_item.added", output_index=i,
                 item={**item, "status": "in_progress", "arguments": ""})  # fmt: skip
            emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
            emit("response.function_call_arguments.done", **at, arguments=item["arguments"])
        else:  # custom_tool_call
            emit(
                "response.output_item.added",
                output_index=i,
                item={**item, "status": "in_progress", "input": ""},
            )
            emit("response.custom_tool_call_input.delta", **at, delta=item["input"])
            emit("response.custom_tool_call_input.done", **at, input=item["input"])
        emit("response.output_item.done", output_index=i, item=item)
    emit(
        "response.incomplete" if response["status"] == "incomplete" else "response.completed",
        response=response,
    )
    return events


def _pieces(text: str) -> list[str]:
    return [text[i : i + STREAM_CHARS] for i in range(0, len(text), STREAM_CHARS)]


def sse(event: dict[str, Any]) -> bytes:
    """One event as server-sent event bytes (its type as the SSE event name, as OpenAI's servers send)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
