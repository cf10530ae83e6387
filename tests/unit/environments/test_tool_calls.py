"""The tool-call parser: valid calls round-trip, every malformed turn is a one-line error, nothing raises."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_rollouts.environments.tool_calls import (
    CLOSE_TAG,
    OPEN_TAG,
    TOOLS,
    ToolCall,
    ToolCallError,
    parse_tool_call,
    render_call,
)


def _call(name: str, **arguments: str) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def _error(text: str, **kwargs: int) -> str:
    result = parse_tool_call(text, **kwargs)
    assert isinstance(result, ToolCallError), result
    return result.message


@pytest.mark.parametrize(
    "call",
    [
        _call("bash", cmd="pytest -q"),
        _call("write_file", path="solution.py", content='def f(x):\n    return "é\\n" * x\n'),
        _call("read_file", path="solution.py"),
        _call("submit"),
    ],
)
def test_render_then_parse_round_trips(call: ToolCall) -> None:
    text = render_call(call)
    assert text.startswith(OPEN_TAG) and text.endswith(CLOSE_TAG)
    assert parse_tool_call(text) == call
    assert parse_tool_call(f"I will act now.\n{text}\nDone.") == call


def test_rendered_text_is_the_documented_format() -> None:
    text = render_call(_call("bash", cmd="pytest -q"))
    assert text == '<tool_call>{"name": "bash", "arguments": {"cmd": "pytest -q"}}</tool_call>'


def test_submit_may_leave_out_arguments() -> None:
    assert parse_tool_call('<tool_call>{"name": "submit"}</tool_call>') == _call("submit")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("just thinking", "error: no tool call"),
        ('{"name": "submit"}</tool_call>', "without <tool_call>"),
        ('<tool_call>{"name": "submit"}', "is not closed"),
        (
            '<tool_call>{"name": "submit"}</tool_call><tool_call>{"name": "submit"}</tool_call>',
            "2 tool calls",
        ),
        ('<tool_call>{"name": "submit"}</tool_call></tool_call>', "more than one </tool_call>"),
        ('<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}</tool_call>', "not valid JSON"),
        ("<tool_call></tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object, got an array"),
        (
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
            "unknown tool 'rm'; tools are bash, write_file",
        ),
        ('<tool_call>{"arguments": {}}</tool_call>', "has no 'name'"),
        ('<tool_call>{"name": 3}</tool_call>', "'name' must be a string, got a number"),
        ('<tool_call>{"name": "bash", "args": {}}</tool_call>', "unexpected key 'args'"),
        ('<tool_call>{"name": "bash", "arguments": "ls"}</tool_call>', "must be a JSON object, got a string"),
        ('<tool_call>{"name": "bash", "arguments": {}}</tool_call>', "bash is missing argument 'cmd'"),
        (
            '<tool_call>{"name": "write_file", "arguments": {"path": "a.py"}}</tool_call>',
            "write_file is missing argument 'content'",
        ),
        (
            '<tool_call>{"name": "read_file", "arguments": {"path": "a", "mode": "r"}}</tool_call>',
            "unexpected argument 'mode'; it takes path",
        ),
        ('<tool_call>{"name": "submit", "arguments": {"x": "1"}}</tool_call>', "it takes no arguments"),
        (
            '<tool_call>{"name": "bash", "arguments": {"cmd": ["ls"]}}</tool_call>',
            "must be a string, got an array",
        ),
        ('<tool_call>{"name": "bash", "arguments": {"cmd": null}}</tool_call>', "must be a string, got null"),
        ('<tool_call>{"name": "bash", "arguments": {"cmd": true}}</tool_call>', "got a boolean"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "not valid JSON"),
        ("<tool_call>" + "9" * 5000 + "</tool_call>", "not valid JSON"),
    ],
)
def test_malformed_turns_are_one_line_errors(text: str, expected: str) -> None:
    message = _error(text, max_chars=200_000)
    assert expected in message
    assert message.startswith("error: ")
    assert len(message.splitlines()) == 1


def test_oversized_turn_is_rejected_before_parsing() -> None:
    text = render_call(_call("bash", cmd="x" * 100))
    assert "the limit is 50" in _error(text, max_chars=50)


def test_model_text_is_quoted_short_and_on_one_line() -> None:
    name = "evil\nname\u2028" + "x" * 500
    message = _error(f'<tool_call>{{"name": "{name.encode("unicode_escape").decode()}"}}</tool_call>')
    assert len(message.splitlines()) == 1
    assert len(message) < 160


def test_render_refuses_invalid_calls() -> None:
    with pytest.raises(ValueError, match="unknown tool"):
        render_call(_call("rm", path="/"))
    with pytest.raises(ValueError, match="contains"):
        render_call(_call("write_file", path="a.py", content="s = '</tool_call>'"))


def test_tool_table_matches_the_documented_tools() -> None:
    assert TOOLS == {
        "bash": ("cmd",),
        "write_file": ("path", "content"),
        "read_file": ("path",),
        "submit": (),
    }


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_never_raises(text: str) -> None:
    result = parse_tool_call(text)
    if isinstance(result, ToolCallError):
        assert len(result.message.splitlines()) == 1
    else:
        assert result.name in TOOLS


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([*TOOLS, "rm", ""]), _JSONISH, st.text(max_size=30), st.text(max_size=30))
def test_arbitrary_calls_never_raise(name: str, arguments: object, before: str, after: str) -> None:
    body = json.dumps({"name": name, "arguments": arguments})
    result = parse_tool_call(f"{before}{OPEN_TAG}{body}{CLOSE_TAG}{after}")
    if isinstance(result, ToolCallError):
        assert len(result.message.splitlines()) == 1
        assert len(result.message) < 200
    else:
        assert set(result.arguments) == set(TOOLS[result.name])
