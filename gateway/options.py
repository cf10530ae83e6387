"""What a harness's request asks of the gateway beyond its conversation, honoured or refused (pure).

Invariants:
- Every field of a request is honoured, refused or ignored for a stated reason, never dropped unseen
  (`request_options`, the table in docs/harness.md): what leaves the sampled tokens' logprob meaning intact
  is honoured (``max_tokens``, ``stop``, ``tool_choice`` none/auto, ``n=1``, streaming, ``seed`` recorded);
  a sampling setting other than the run's is a 400 naming the field (`BadChatRequest.param`).
- A refusal is OpenAI's error body (`error`), so clients read it as they read OpenAI's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def error(
    message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """An OpenAI error body (``context_length_exceeded`` makes clients such as litellm stop retrying);
    ``param`` names the request field it is about."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class BadChatRequest(ValueError):
    """A request the gateway cannot serve (answered 400 with the message, as an OpenAI server would), and
    the request field it is about (``param``) with OpenAI's error code for it."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error(str(self), code=self.code, param=self.param)


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
