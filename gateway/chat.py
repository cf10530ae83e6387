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
- A request's other fields are honoured, refused or ignored for a stated reason, never dropped unseen
  (`request_options`, the table in docs/harness.md): what leaves the sampled tokens' logprob meaning intact
  is honoured (``max_tokens``, ``stop``, ``tool_choice`` none/auto, ``n=1``, streaming, ``seed`` recorded);
  a sampling setting other than the run's is a 400 naming the field (``BadChatRequest.param``).
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

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.S)


class BadChatRequest(ValueError):
    """A request the gateway cannot serve (answered 400 with the message, as an OpenAI server would), and
    the request field it is about (``param``) with OpenAI's error code for it."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error(str(self), code=self.code, param=self.param)


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


@dataclass(frozen=True)
class RunSampling:
    """The run's sampling settings a request may repeat but not change (``[sampling]`` of its config)."""

    temperature: float
    top_p: float
    top_k: int
    min_tokens: int


@dataclass(frozen=True)
class Options:
    """What a request asks of its answer besides the conversation and the tools (`request_options`)."""

    max_tokens: int | None = None
    """The most the answer may sample (``max_tokens``/``max_completion_tokens``, the smaller); the run's
    cap (``sampling.max_tokens``, and the room left in the rollout's budget) still applies."""
    stop: tuple[str, ...] = ()
    seed: int | None = None
    """Recorded with the sample (segment meta ``request``); the rollout samples with its own seed."""
    tool_choice: str = "auto"
    """``auto`` or ``none`` (tools not offered: the template renders none, no tool call is parsed)."""
    stream: bool = False
    include_usage: bool = False

    def recorded(self) -> dict[str, Any]:
        """What the call records of them (with its request, and in its key): the fields that shape the
        answer, only where not the default. Streaming is presentation only: not recorded."""
        out: dict[str, Any] = {}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.stop:
            out["stop"] = list(self.stop)
        if self.seed is not None:
            out["seed"] = self.seed
        if self.tool_choice != "auto":
            out["tool_choice"] = self.tool_choice
        return out

    @classmethod
    def of_request(cls, request: dict[str, Any]) -> Options:
        """The options a recorded request holds (`recorded`); none for a request recorded without."""
        rec = request.get("options") or {}
        return cls(
            max_tokens=rec.get("max_tokens"),
            stop=tuple(rec.get("stop") or ()),
            seed=rec.get("seed"),
            tool_choice=rec.get("tool_choice", "auto"),
        )

    def offered(self, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """The tools the model is shown (rendered by the chat template): none under ``tool_choice: none``
        (an empty list is none)."""
        return None if self.tool_choice == "none" else tools or None


IGNORED: dict[str, str] = {
    "model": "the rollout's model answers every call (the answer names it)",
    "user": "an end-user id for abuse monitoring: nothing to monitor inside a rollout",
    "metadata": "labels for stored completions: every call is stored with its rollout anyway",
    "store": "every call is stored with its rollout anyway",
    "service_tier": "one tier: the rollout's engines",
    "prompt_cache_key": "the engine caches prefixes by their tokens on its own",
    "safety_identifier": "an end-user id for abuse monitoring: nothing to monitor inside a rollout",
}
"""Request fields accepted and not acted on, each with its reason (docs/harness.md's table)."""

_NEUTRAL: dict[str, tuple[Any, str]] = {
    "presence_penalty": (0, "a penalty changes the distribution the logprobs describe"),
    "frequency_penalty": (0, "a penalty changes the distribution the logprobs describe"),
    "repetition_penalty": (1, "a penalty changes the distribution the logprobs describe"),
    "min_p": (0, "a cut-off changes the distribution the logprobs describe"),
    "logit_bias": ({}, "a bias changes the distribution the logprobs describe"),
    "logprobs": (False, "the answer carries no logprobs (the run stores them with every sample)"),
    "top_logprobs": (0, "the answer carries no logprobs (the run stores them with every sample)"),
    "parallel_tool_calls": (True, "only a grammar could stop the model writing several tool calls"),
    "response_format": ({"type": "text"}, "a format is enforced only by constrained decoding"),
}
"""Fields the run never sets: accepted absent, null or at their neutral value, refused otherwise for the
reason given (a value that would change what is sampled or its logprobs' meaning, ask for what the gateway
does not return, or for what it cannot enforce)."""
_RUN = ("temperature", "top_p", "top_k", "min_tokens")
"""Fields that must equal the run's setting (`RunSampling`) when given."""
_HANDLED = frozenset(
    {"messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "stop", "n", "seed",
     "stream", "stream_options"}
)  # fmt: skip


def request_options(body: dict[str, Any], run: RunSampling | None) -> Options:
    """The options of a ``/v1/chat/completions`` body, every field honoured, checked against the run's
    sampling (``run``; None: unknown, so any sampling setting is refused), refused, or ignored for its
    reason (`IGNORED`).

    Raises:
        BadChatRequest: a field that is refused, or not of its type; ``param`` names it.
    """
    for name in body:
        if name not in _HANDLED and name not in IGNORED and name not in _NEUTRAL and name not in _RUN:
            raise BadChatRequest(
                f"'{name}' is not served by this gateway (docs/harness.md lists the fields it serves)",
                name, "unsupported_parameter",
            )  # fmt: skip
    for name, (neutral, why) in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not _same(value, neutral):
            raise BadChatRequest(
                f"'{name}' {json.dumps(value)} is not served: {why}", name, "unsupported_value"
            )
    for name in _RUN:
        if body.get(name) is None:
            continue
        value = _number(body, name, integer=name in ("top_k", "min_tokens"))
        if run is None:
            raise BadChatRequest(
                f"'{name}' cannot be checked: this gateway does not know the run's sampling settings; "
                "leave it out", name, "unsupported_value",
            )  # fmt: skip
        want = getattr(run, name)
        if not (value == want or (name == "top_k" and value <= 0 and want <= 0)):  # top_k 0 and -1: off
            raise BadChatRequest(
                f"'{name}' {value} differs from the run's {want}: the rollout's samples are stored with "
                "their logprobs under the run's sampling settings; leave it out or send the run's value",
                name, "unsupported_value",
            )  # fmt: skip
    n = body.get("n")
    if n is not None and (_number(body, "n", integer=True) != 1):
        raise BadChatRequest("only n=1 is served (one answer per call)", "n", "unsupported_value")
    return Options(
        max_tokens=_max_tokens(body),
        stop=_stop(body.get("stop")),
        seed=_number(body, "seed", integer=True) if body.get("seed") is not None else None,
        tool_choice=_tool_choice(body.get("tool_choice")),
        stream=_stream(body),
        include_usage=_include_usage(body),
    )


def _same(value: Any, neutral: Any) -> bool:
    """``value`` is the neutral one (booleans only as themselves, numbers whatever their type)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    return bool(value == neutral)


def _number(body: dict[str, Any], name: str, integer: bool = False) -> Any:
    value = body[name]
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if not ok or isinstance(value, bool):
        kind = "an integer" if integer else "a number"
        raise BadChatRequest(f"'{name}' must be {kind}", name, "invalid_type")
    return value


def _max_tokens(body: dict[str, Any]) -> int | None:
    given = []
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            value = _number(body, name, integer=True)
            if value < 1:
                raise BadChatRequest(f"'{name}' must be at least 1", name, "invalid_value")
            given.append(value)
    return min(given) if given else None


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadChatRequest("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if any(not s for s in stops):
        raise BadChatRequest("'stop' cannot hold an empty string", "stop", "invalid_value")
    return tuple(dict.fromkeys(stops))


def _tool_choice(value: Any) -> str:
    if value is None or value == "auto":
        return "auto"
    if value == "none":
        return "none"
    raise BadChatRequest(
        f"tool_choice {json.dumps(value)} is not served: forcing a tool call takes constrained decoding, "
        "which changes the sampled tokens' logprobs; send 'auto' (the model calls a tool when it writes "
        "one) or 'none'",
        "tool_choice", "unsupported_value",
    )  # fmt: skip


def _stream(body: dict[str, Any]) -> bool:
    value = body.get("stream")
    if value is not None and not isinstance(value, bool):
        raise BadChatRequest("'stream' must be a boolean", "stream", "invalid_type")
    return bool(value)


def _include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not body.get("stream"):
        raise BadChatRequest("'stream_options' is only allowed with stream: true", "stream_options")
    if not isinstance(opts, dict):
        raise BadChatRequest("'stream_options' must be an object", "stream_options", "invalid_type")
    for key in opts:
        if key not in ("include_usage", "include_obfuscation"):
            raise BadChatRequest(
                f"stream_options.{key} is not served", "stream_options", "unsupported_parameter"
            )
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise BadChatRequest(
            "stream_options.include_usage must be a boolean", "stream_options", "invalid_type"
        )
    return bool(usage)


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
    out: list[dict[str, Any]] = []
    for m in messages:
        shown = next((r for a, r in answers if same_answer(m, a)), None)
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


def error(
    message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """An OpenAI error body (``context_length_exceeded`` makes clients such as litellm stop retrying);
    ``param`` names the request field it is about."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
