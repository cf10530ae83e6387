"""The OpenAI chat shapes of the gateway, and how a harness's conversation maps onto stored tokens (pure).

Invariants:
- A harness's earlier assistant message maps back to the tokens that were sampled for it: it must carry
  exactly the content and tool calls the gateway answered (`same_answer`); it is then rendered as the raw
  text the model wrote (`canonical`), and the stored sampled tokens stand for it. No sampled token is ever
  re-tokenized into the stored sequence.
- A call whose messages extend the previous call's messages plus the answer (`extends`) appends only the
  template's tokens for the new messages (`template_delta`); anything else is a rewrite (the harness
  truncated or summarised its history): a new token sequence starts, and the reason says where.
- Tool calls are parsed in the model's own format and answered in OpenAI's shape: by default
  ``<tool_call>{"name", "arguments"}</tool_call>`` (`parse_answer`, as ``environments.tool_calls`` renders
  it), or by the vLLM parsers a run names (``gateway.formats``), which also answer the model's reasoning as
  ``reasoning_content``; a block that does not parse stays in the content, so the harness sees what the
  model wrote.
- A request's other fields are honoured, refused or ignored for a stated reason (``gateway.options``).
- A stop string cuts the answer, never the stored tokens: the engine stops on it itself and its tokens are
  stored as it returned them; the answer's content ends before the first stop string in the model's text
  (`cut_at_stop`), and the next call extends the stored tokens (the raw text stands for the answer).
- A streamed answer is the stored answer in chunks (`stream_chunks`, a pure function of it): a client that
  retries a broken stream gets the same chunks.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from durable_rollouts.gateway.options import BadChatRequest, Options

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.S)


def text_of(content: Any) -> str:
    """A message's content as text (OpenAI allows a list of parts; only text parts are kept)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    raise BadChatRequest(f"message content must be a string or a list of parts, got {type(content).__name__}")


def request_messages(body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools of a ``/v1/chat/completions`` body (each message checked for a role)."""
    if not isinstance(body, dict):
        raise BadChatRequest("request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadChatRequest("'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadChatRequest(f"messages[{i}]: each message needs a string 'role'")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadChatRequest("'tools' must be a list", "tools", "invalid_type")
    return msgs, tools


def request_key(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, options: Options | None = None
) -> str:
    """What makes two requests the same call (a client's retry): the conversation, the tools and the
    options that shape the answer (`Options.recorded`; a request without any keys as before they were)."""
    norm = [_norm_message(m) for m in messages]
    obj: dict[str, Any] = {"m": norm, "t": tools}
    if options is not None and options.recorded():
        obj["o"] = options.recorded()
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _norm_message(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m["role"], "content": text_of(m.get("content"))}
    calls = _calls_of(m)
    if calls:
        out["tool_calls"] = calls
    return out


def _calls_of(m: dict[str, Any]) -> list[tuple[Any, Any]]:
    """An assistant message's tool calls as (name, parsed arguments): ids and JSON spacing ignored."""
    out = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = args
        out.append((fn.get("name"), parsed))
    return out


@dataclass(frozen=True)
class Parsed:
    """What the model wrote, as an OpenAI assistant message."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    reasoning_content: str | None = None
    """The model's reasoning, where a reasoning parser read it apart from the content."""


def parse_answer(raw: str, call_index: int) -> Parsed:
    """The model's raw text (end-of-turn marker stripped) as content plus tool calls; call ids are
    deterministic (``call_<index>_<k>``) so an answer delivered twice is the same answer."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(raw):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            continue  # not a tool call: it stays in the content
        kept.append(raw[pos : m.start()])
        pos = m.end()
        calls.append(
            {
                "id": f"call_{call_index}_{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
        )
    kept.append(raw[pos:])
    content = "".join(kept).strip() if calls else raw
    return Parsed(content=content or None, tool_calls=calls)


def cut_at_stop(raw: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """The answer's text: the model's ``raw`` text up to the first of the ``stop`` strings in it (not
    included, as OpenAI's servers answer), and whether one was found."""
    at = min((i for i in (raw.find(s) for s in stop) if i >= 0), default=-1)
    return (raw, False) if at < 0 else (raw[:at], True)


def same_answer(message: dict[str, Any], answer: dict[str, Any]) -> bool:
    """Whether a harness's assistant message is the answer the gateway gave (content and tool calls;
    call ids, extra keys and JSON spacing aside)."""
    if message.get("role") != "assistant":
        return False
    return text_of(message.get("content")).strip() == text_of(answer.get("content")).strip() and _calls_of(
        message
    ) == _calls_of(answer)


def rendered_answer(message: dict[str, Any]) -> dict[str, Any]:
    """An answer as a later prompt renders it when a vLLM parser read it: the OpenAI message the harness
    was given (its text, tool calls and reasoning; ``reasoning`` is the field vLLM's server hands the chat
    template as ``reasoning``/``reasoning_content``), as vLLM's own server renders a conversation its
    client sends back."""
    out: dict[str, Any] = {"role": "assistant", "content": text_of(message.get("content"))}
    calls = [
        {"id": c.get("id"), "type": "function", "function": dict(c.get("function") or {})}
        for c in message.get("tool_calls") or []
        if isinstance(c, dict)
    ]
    if calls:
        out["tool_calls"] = calls
    if message.get("reasoning_content"):
        out["reasoning"] = message["reasoning_content"]
    return out


def canonical(
    messages: list[dict[str, Any]], answers: list[tuple[dict[str, Any], str | dict[str, Any]]]
) -> list[dict[str, Any]]:
    """The conversation as the template renders it: role and text only, and every assistant message that
    is one of ``answers`` (answer message, how it renders) replaced by how it renders: the raw text the
    model wrote (a string), or the message a vLLM parser's answer renders as (`rendered_answer`)."""
    by_text: dict[str, list[tuple[dict[str, Any], str | dict[str, Any]]]] = {}
    for a, r in answers:  # looked up by text first: one pass over the conversation, not one per answer
        by_text.setdefault(text_of(a.get("content")).strip(), []).append((a, r))
    out: list[dict[str, Any]] = []
    for m in messages:
        shown = None
        if m.get("role") == "assistant":
            found = by_text.get(text_of(m.get("content")).strip(), ())
            shown = next((r for a, r in found if same_answer(m, a)), None)
        if isinstance(shown, dict):
            out.append(shown)
        elif shown is not None:
            out.append({"role": "assistant", "content": shown})
        else:
            out.append({"role": m["role"], "content": text_of(m.get("content"))})
    return out


def extends(new: list[dict[str, Any]], previous: list[dict[str, Any]]) -> int | None:
    """None when ``new`` starts with ``previous``; else the index of the first message that differs."""
    for i, m in enumerate(previous):
        if i >= len(new) or new[i] != m:
            return i
    return None


def template_delta(full: list[int], prefix: list[int]) -> list[int] | None:
    """The tokens the template adds after ``prefix`` (a closed conversation) to render ``full``; None when
    the template is not append-only here (``full`` does not start with ``prefix``)."""
    if full[: len(prefix)] != prefix:
        return None
    return full[len(prefix) :]


def completion(
    rollout_id: str, call_index: int, model: str, parsed: Parsed, finish: str, prompt_n: int, sampled_n: int
) -> dict[str, Any]:
    """The ``chat.completion`` object of one answered call."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning_content is not None:
        message["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    reason = "tool_calls" if parsed.tool_calls and finish == "stop" else finish
    return {
        "id": f"chatcmpl-{hashlib.sha256(f'{rollout_id}/{call_index}'.encode()).hexdigest()[:24]}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt_n,
            "completion_tokens": sampled_n,
            "total_tokens": prompt_n + sampled_n,
        },
    }


STREAM_CHARS = 16
"""Most characters of the answer's content in one streamed chunk."""


def stream_chunks(body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A stored ``chat.completion`` as the ``chat.completion.chunk`` objects of its stream (pure: the same
    answer gives the same chunks): the role, the reasoning (``reasoning_content``) then the content in
    pieces of `STREAM_CHARS`, each tool call whole, the finish reason; with ``include_usage``, every chunk
    has ``usage: null`` and a last chunk with no choices carries the answer's usage."""
    choice = body["choices"][0]
    message = choice["message"]
    head = {
        "id": body["id"],
        "object": "chat.completion.chunk",
        "created": body["created"],
        "model": body["model"],
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    text = message.get("content") or ""
    thought = message.get("reasoning_content") or ""
    chunks = [chunk({"role": "assistant", "content": "" if text else None})]
    chunks += [
        chunk({"reasoning_content": thought[i : i + STREAM_CHARS]})
        for i in range(0, len(thought), STREAM_CHARS)
    ]
    chunks += [chunk({"content": text[i : i + STREAM_CHARS]}) for i in range(0, len(text), STREAM_CHARS)]
    chunks += [
        chunk({"tool_calls": [{"index": i, **c}]}) for i, c in enumerate(message.get("tool_calls") or [])
    ]
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return chunks
