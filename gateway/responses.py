"""OpenAI's Responses API (``POST /v1/responses``, what Codex CLI speaks) as the gateway's chat calls (pure):
a request's input items become the chat messages and tools a chat call records, and its answer is read
back as output items (``gateway.response_items``).

Invariants:
- One model call path: a Responses request is converted to the conversation, tools and options of a chat
  call (`request_call`), recorded and answered as one (``gateway.turn`` reads it as it reads any call),
  so durability, token-exactness and the request checks are the chat API's: a request repeated is the same
  call, a later call must extend the stored tokens, a sampling setting other than the run's is a 400
  naming the field (``gateway.options.request_options``, with the Responses name of the field).
- Input items map onto chat messages as the answer was given: the output items of one answer (reasoning,
  message, function and custom tool calls) sent back become one assistant message with its content,
  ``reasoning_content`` and ``tool_calls`` (call id = the item's ``call_id``), which
  ``gateway.chat.same_answer`` matches against the stored answer; ``function_call_output`` and
  ``custom_tool_call_output`` become ``tool`` messages; ``instructions`` and ``developer`` messages become
  ``system`` messages (the role chat templates render).
- Custom tools (free-form input, e.g. Codex's ``apply_patch``) are offered to the model as function tools
  with one string argument, ``input`` (their grammar in the description); a call of one is answered as a
  ``custom_tool_call`` with that string. Which tools are custom is recorded with the call
  (``custom_tools``), so the answer reads the same on every retry.
- Every request field is honoured, refused, or accepted and not acted on for a stated reason
  (`IGNORED`, the table in docs/harness.md); what needs server-side state (``previous_response_id``,
  ``conversation``, ``background``) is refused: the client sends the whole input (``store: false``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from durable_rollouts.gateway import chat
from durable_rollouts.gateway.options import BadChatRequest, Options, RunSampling, request_options

API = "responses"
"""The ``api`` a Responses call is recorded with (a chat call records none)."""
CUSTOM_ARG = "input"
"""The one argument of a custom tool as the model is shown it (a function tool)."""

IGNORED: dict[str, str] = {
    "client_metadata": "client telemetry labels: every call is stored with its rollout anyway",
    "include": "reasoning is answered in the clear (reasoning_text), never encrypted",
    "truncation": "the gateway never truncates a conversation ('disabled'); 'auto' is refused",
}
"""Responses-only request fields accepted and not acted on, each with its reason (the chat API's
``gateway.options.IGNORED`` apply too)."""
_CHAT_FIELDS = (
    "model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    "temperature", "top_p", "top_logprobs", "parallel_tool_calls", "stream", "stream_options",
)  # fmt: skip
"""Fields with the same name and meaning in both APIs: checked by the chat API's rules."""
_REFUSED: dict[str, str] = {
    "previous_response_id": "the gateway keeps no response state: send the whole input (store: false)",
    "conversation": "the gateway keeps no conversation state: send the whole input",
    "background": "a call is answered while the client waits (or streamed)",
    "prompt": "stored prompt templates are not served: send instructions and input",
    "max_tool_calls": "only a grammar could stop the model writing more tool calls",
}
"""Fields refused when set (not null/false), with the reason."""
_HANDLED = frozenset(
    {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "reasoning", "text"}
)
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})


@dataclass(frozen=True)
class Call:
    """A Responses request as the chat call it is recorded as."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    options: Options
    custom_tools: tuple[str, ...]
    """Names of the tools offered as custom tools (their calls are answered as ``custom_tool_call``)."""

    def key(self) -> str:
        """What makes two requests the same call: the chat key of the conversation, tools and options, and
        that it is a Responses call with these custom tools."""
        base = chat.request_key(self.messages, self.tools, self.options)
        blob = json.dumps([API, base, list(self.custom_tools)], separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def recorded(self) -> dict[str, Any]:
        """The request as the store records it: a chat call's fields (``gateway.turn`` reads them), the
        ``api`` and the custom tools' names."""
        out: dict[str, Any] = {"messages": self.messages, "tools": self.tools, "api": API}
        if self.options.recorded():
            out["options"] = self.options.recorded()
        if self.custom_tools:
            out["custom_tools"] = list(self.custom_tools)
        return out


def request_call(body: Any, run: RunSampling | None) -> Call:
    """A ``/v1/responses`` body as a chat call.

    Raises:
        BadChatRequest: a field refused or malformed; ``param`` names it as the Responses API does.
    """
    if not isinstance(body, dict):
        raise BadChatRequest("request body must be a JSON object")
    for name in body:
        if name not in _HANDLED and name not in _CHAT_FIELDS and name not in IGNORED and name not in _REFUSED:
            raise BadChatRequest(
                f"'{name}' is not served by this gateway (docs/harness.md lists the fields it serves)",
                name, "unsupported_parameter",
            )  # fmt: skip
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False):
            raise BadChatRequest(f"'{name}' is not served: {why}", name, "unsupported_parameter")
    _check_ignored(body)
    _check_reasoning(body.get("reasoning"))
    _check_text(body.get("text"))
    tools, custom = _tools(body.get("tools"))
    messages = _messages(body.get("input"), body.get("instructions"), set(custom))
    chat_body: dict[str, Any] = {k: body[k] for k in _CHAT_FIELDS if k in body}
    chat_body["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat_body["max_tokens"] = body["max_output_tokens"]
    if body.get("tool_choice") is not None:
        chat_body["tool_choice"] = _tool_choice(body["tool_choice"])
    try:
        options = request_options(chat_body, run)
    except BadChatRequest as e:
        if e.param == "max_tokens":
            raise BadChatRequest(str(e).replace("'max_tokens'", "'max_output_tokens'"),
                                 "max_output_tokens", e.code) from None  # fmt: skip
        raise
    return Call(messages, tools or None, options, tuple(custom))


def _check_ignored(body: dict[str, Any]) -> None:
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
            raise BadChatRequest("'include' must be a list of strings", "include", "invalid_type")
        for v in include:
            if v not in _INCLUDABLE:
                raise BadChatRequest(
                    f"include {v!r} is not served (the answer carries no logprobs, sources or "
                    "hosted-tool outputs)", "include", "unsupported_value",
                )  # fmt: skip
    if body.get("truncation") not in (None, "disabled"):
        raise BadChatRequest(
            f"truncation {json.dumps(body['truncation'])} is not served: the gateway never truncates a "
            "conversation (it would not extend the stored tokens); send 'disabled'",
            "truncation", "unsupported_value",
        )  # fmt: skip
    meta = body.get("client_metadata")
    if meta is not None and not isinstance(meta, dict):
        raise BadChatRequest("'client_metadata' must be an object", "client_metadata", "invalid_type")


def _check_reasoning(value: Any) -> None:
    """``reasoning``: ``summary`` accepted (the reasoning is answered whole, as ``reasoning_text``); an
    ``effort`` is refused: the prompt the rollout renders does not carry it."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise BadChatRequest("'reasoning' must be an object", "reasoning", "invalid_type")
    for key, v in value.items():
        if key in ("summary", "generate_summary"):
            continue
        if key == "effort" and v is None:
            continue
        raise BadChatRequest(
            f"reasoning.{key} {json.dumps(v)} is not served: the model reasons as its chat template renders "
            "the prompt; leave it out", "reasoning", "unsupported_value",
        )  # fmt: skip


def _check_text(value: Any) -> None:
    """``text``: plain text output only (a format is enforced only by constrained decoding); the
    verbosity, a hint to OpenAI's models, is refused unless the default."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise BadChatRequest("'text' must be an object", "text", "invalid_type")
    fmt = value.get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise BadChatRequest(
            f"text.format {json.dumps(fmt)} is not served: a format is enforced only by constrained "
            "decoding, which changes the sampled tokens' logprobs", "text", "unsupported_value",
        )  # fmt: skip
    for key, v in value.items():
        if key == "format" or (key == "verbosity" and v in (None, "medium")):
            continue
        raise BadChatRequest(f"text.{key} {json.dumps(v)} is not served", "text", "unsupported_value")


def _tool_choice(value: Any) -> Any:
    """A Responses ``tool_choice`` in the chat API's shape (a named function nests under ``function``)."""
    if isinstance(value, dict) and value.get("type") in ("function", "custom") and "name" in value:
        return {"type": "function", "function": {"name": value["name"]}}
    return value


def _tools(value: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Function and custom tools as chat function tools, and the custom ones' names."""
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise BadChatRequest("'tools' must be a list", "tools", "invalid_type")
    out: list[dict[str, Any]] = []
    custom: list[str] = []
    for i, t in enumerate(value):
        kind = t.get("type") if isinstance(t, dict) else None
        name = t.get("name") if isinstance(t, dict) else None
        if kind not in ("function", "custom"):
            raise BadChatRequest(
                f"tools[{i}]: a {json.dumps(kind)} tool is not served: only function and custom tools are "
                "(the model calls them, the harness runs them); turn the client's hosted tools off",
                "tools", "unsupported_value",
            )  # fmt: skip
        if not isinstance(name, str) or not name:
            raise BadChatRequest(f"tools[{i}]: a tool needs a string 'name'", "tools", "invalid_value")
        fn: dict[str, Any] = {"name": name}
        if kind == "function":
            if t.get("description"):
                fn["description"] = t["description"]
            fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
        else:
            custom.append(name)
            fn["description"] = _custom_description(t)
            fn["parameters"] = {
                "type": "object",
                "properties": {CUSTOM_ARG: {"type": "string", "description": "the tool's input, verbatim"}},
                "required": [CUSTOM_ARG],
            }
        out.append({"type": "function", "function": fn})
    return out, custom


def _custom_description(tool: dict[str, Any]) -> str:
    """A custom tool's description for the model: its own, then its input's format (a grammar's
    definition in full)."""
    text = str(tool.get("description") or "")
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        text += f"\n\nInput grammar ({fmt.get('syntax', 'grammar')}):\n{fmt.get('definition', '')}"
    return text.strip()


_RANK = {"reasoning": 0, "message": 1, "function_call": 2, "custom_tool_call": 2}
"""The order of one answer's output items (`gateway.response_items.output_items`): an item ranked lower
than the one before it starts the next answer."""


def _messages(value: Any, instructions: Any, custom: set[str]) -> list[dict[str, Any]]:
    """``instructions`` and the ``input`` items as chat messages, an answer's output items merged into
    one assistant message."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadChatRequest("'instructions' must be a string", "instructions", "invalid_type")
        if instructions:
            out.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadChatRequest("'input' must be a string or a non-empty list of items", "input", "invalid_type")
    answer: dict[str, Any] | None = None
    rank = -1
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise BadChatRequest(f"input[{i}] must be an object", "input", "invalid_type")
        kind = item.get("type", "message")
        role = item.get("role")
        if kind in _RANK and (kind != "message" or role == "assistant"):
            repeated = _RANK[kind] == rank and _RANK[kind] < _RANK["function_call"]  # calls come several
            if answer is None or _RANK[kind] < rank or repeated:
                answer = {"role": "assistant", "content": ""}
                out.append(answer)
            rank = _RANK[kind]
            _add_to_answer(answer, item, i, custom)
            continue
        answer, rank = None, -1
        if kind == "message":
            if role not in ("user", "system", "developer"):
                raise BadChatRequest(f"input[{i}]: role {json.dumps(role)} is not served", "input")
            text = _text(item.get("content"), i)
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise BadChatRequest(f"input[{i}]: {kind} needs a string 'call_id'", "input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), i)})
        else:
            raise BadChatRequest(
                f"input[{i}]: a {json.dumps(kind)} item is not served (messages, reasoning, function and "
                "custom tool calls and their outputs are)", "input", "unsupported_value",
            )  # fmt: skip
    return out


def _add_to_answer(answer: dict[str, Any], item: dict[str, Any], i: int, custom: set[str]) -> None:
    kind = item.get("type", "message")
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        answer["reasoning_content"] = _text(parts, i)
    elif kind == "message":
        answer["content"] = _text(item.get("content"), i)
    else:
        name, call_id = item.get("name"), item.get("call_id")
        if not isinstance(name, str) or not isinstance(call_id, str):
            raise BadChatRequest(f"input[{i}]: {kind} needs a string 'name' and 'call_id'", "input")
        if kind == "function_call":
            args = item.get("arguments")
            if not isinstance(args, str):
                raise BadChatRequest(f"input[{i}]: function_call 'arguments' must be a string", "input")
        else:
            raw = item.get("input")
            if not isinstance(raw, str):
                raise BadChatRequest(f"input[{i}]: custom_tool_call 'input' must be a string", "input")
            args = json.dumps({CUSTOM_ARG: raw})
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        answer.setdefault("tool_calls", []).append(call)


def _text(content: Any, i: int) -> str:
    """An item's content as text: a string, or its text parts (``input_text``, ``output_text``,
    ``reasoning_text``, ``summary_text``, ``text``) joined; an image or file part is refused."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadChatRequest(f"input[{i}]: content must be a string or a list of parts", "input")
    texts = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text", "reasoning_text", "summary_text", "text"):
            texts.append(str(p.get("text", "")))
        elif kind == "refusal":
            texts.append(str(p.get("refusal", "")))
        else:
            raise BadChatRequest(
                f"input[{i}]: a {json.dumps(kind)} content part is not served (text only)",
                "input", "unsupported_value",
            )  # fmt: skip
    return "".join(texts)
