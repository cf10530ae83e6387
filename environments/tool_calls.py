"""The coding environment's tool-call format and its parser.

Invariant: `parse_tool_call` never raises on model output. Whatever the model wrote, it returns either one
valid `ToolCall` or a `ToolCallError` whose message is a single short line the harness can show the model
as the observation of that turn.

Format. A model turn contains at most one tool call, written as a JSON object between tags::

    <tool_call>{"name": "bash", "arguments": {"cmd": "pytest -q"}}</tool_call>

- Text before ``<tool_call>`` and after ``</tool_call>`` is allowed and ignored (the model may think aloud).
- The JSON object has the key ``name`` (a string) and the key ``arguments`` (an object of string values);
  ``arguments`` may be left out when the tool takes none. No other keys.
- Tools and their arguments (all strings, all required, no others):

  ============== ======================= =================================================
  ``bash``       ``cmd``                 run a shell command in the sandbox
  ``write_file`` ``path``, ``content``   create or overwrite a file
  ``read_file``  ``path``                read a file
  ``submit``     (none)                  end the episode; the hidden tests are run
  ============== ======================= =================================================

- A turn with no ``<tool_call>``, more than one, an unclosed tag, text longer than ``max_chars``, JSON that
  does not parse, an unknown tool or missing, extra or non-string arguments is a `ToolCallError`.
- The parser looks for the literal tags, so an argument that itself contains ``<tool_call>`` or
  ``</tool_call>`` cannot be expressed; `render_call` refuses to render one.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
DEFAULT_MAX_CHARS = 65536

TOOLS: dict[str, tuple[str, ...]] = {
    "bash": ("cmd",),
    "write_file": ("path", "content"),
    "read_file": ("path",),
    "submit": (),
}
"""Each tool's argument names; every argument is a required string."""

_TOOL_LIST = ", ".join(TOOLS)
_SHOWN = 40
"""Longest piece of model text quoted back in an error message."""


class ToolCall(BaseModel):
    """One valid tool call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """One of `TOOLS`."""
    arguments: dict[str, str]
    """Exactly the tool's arguments."""


class ToolCallError(BaseModel):
    """Why a turn holds no valid tool call; ``message`` is one line meant for the model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    message: str

    def __init__(self, message: str) -> None:
        super().__init__(message=message)


def parse_tool_call(text: str, max_chars: int = DEFAULT_MAX_CHARS) -> ToolCall | ToolCallError:
    """Parse the one tool call in a model turn.

    Args:
        text: The model's turn, detokenized, up to its end token.
        max_chars: Longest turn accepted; a longer one is an error without being scanned.

    Returns:
        The call, or a `ToolCallError` with a one-line observation for the model. Never raises.
    """
    if len(text) > max_chars:
        return ToolCallError(f"error: the turn is {len(text)} characters; the limit is {max_chars}")
    body = _between_tags(text)
    if isinstance(body, ToolCallError):
        return body
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"error: the tool call is not valid JSON ({e.msg} at char {e.pos})")
    except (ValueError, RecursionError):
        return ToolCallError("error: the tool call is not valid JSON")
    return _check_call(obj)


def render_call(call: ToolCall) -> str:
    """The exact text of ``call`` in the format `parse_tool_call` reads.

    Raises:
        ValueError: ``call`` is not valid (see `parse_tool_call`) or an argument contains a tag.
    """
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    if OPEN_TAG in body or CLOSE_TAG in body:
        raise ValueError(f"tool call {call.name}: an argument contains {OPEN_TAG!r} or {CLOSE_TAG!r}")
    text = f"{OPEN_TAG}{body}{CLOSE_TAG}"
    parsed = parse_tool_call(text, max_chars=max(len(text), DEFAULT_MAX_CHARS))
    if isinstance(parsed, ToolCallError):
        raise ValueError(f"invalid tool call: {parsed.message}")
    return text


def _between_tags(text: str) -> str | ToolCallError:
    opens = text.count(OPEN_TAG)
    if opens == 0:
        if CLOSE_TAG in text:
            return ToolCallError(f"error: {CLOSE_TAG} without {OPEN_TAG}")
        return ToolCallError(
            f'error: no tool call; write {OPEN_TAG}{{"name": ..., "arguments": {{...}}}}{CLOSE_TAG}'
        )
    if opens > 1:
        return ToolCallError(f"error: {opens} tool calls in one turn; make one call per turn")
    start = text.index(OPEN_TAG) + len(OPEN_TAG)
    end = text.find(CLOSE_TAG, start)
    if end < 0:
        return ToolCallError(f"error: {OPEN_TAG} is not closed by {CLOSE_TAG}")
    if text.count(CLOSE_TAG) > 1:
        return ToolCallError(f"error: more than one {CLOSE_TAG} in one turn; make one call per turn")
    return text[start:end]


def _check_call(obj: Any) -> ToolCall | ToolCallError:
    if not isinstance(obj, dict):
        return ToolCallError(f"error: the tool call must be a JSON object, got {_json_type(obj)}")
    extra = [k for k in obj if k not in ("name", "arguments")]
    if extra:
        return ToolCallError(
            f"error: unexpected key {_show(extra[0])} in the tool call; use name and arguments"
        )
    name = obj.get("name")
    if name is None:
        return ToolCallError("error: the tool call has no 'name'")
    if not isinstance(name, str):
        return ToolCallError(f"error: 'name' must be a string, got {_json_type(name)}")
    if name not in TOOLS:
        return ToolCallError(f"error: unknown tool {_show(name)}; tools are {_TOOL_LIST}")
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCallError(
            f"error: 'arguments' of {name} must be a JSON object, got {_json_type(arguments)}"
        )
    return _check_arguments(name, arguments)


def _check_arguments(name: str, arguments: dict[str, Any]) -> ToolCall | ToolCallError:
    expected = TOOLS[name]
    for key in expected:
        if key not in arguments:
            return ToolCallError(f"error: {name} is missing argument {key!r}")
    for key, value in arguments.items():
        if key not in expected:
            takes = ", ".join(expected) if expected else "no arguments"
            return ToolCallError(f"error: {name} got unexpected argument {_show(key)}; it takes {takes}")
        if not isinstance(value, str):
            return ToolCallError(
                f"error: argument {key!r} of {name} must be a string, got {_json_type(value)}"
            )
    return ToolCall(name=name, arguments=arguments)


def _show(text: str) -> str:
    """Model text quoted on one line, cut to a few dozen characters."""
    shown = repr(text[:_SHOWN])
    return shown if len(text) <= _SHOWN else shown + "..."


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null"
