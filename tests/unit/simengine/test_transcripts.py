"""The scripted policy's generic script source: a transcripts file (task id, mode -> model turns).

The policy is driven directly, as the server drives it: a chat rendered by the policy's own tokenizer, one
turn per ``<|assistant|>`` marker; each played turn is checked token for token against its transcript.
The coding-task path must keep working beside it (tasks the transcripts file does not name).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from durable_rollouts.errors import TaskFileError
from durable_rollouts.simengine import Mode, ModeRule, SimSettings
from durable_rollouts.simengine.policies import (
    PolicyError,
    PolicyRequest,
    ScriptedPolicy,
    load_transcripts,
    make_policy,
)
from durable_rollouts.simengine.scripts import load_scripted_tasks, script
from durable_rollouts.simengine.tokenizer import SimTokenizer
from tests import REPO_ROOT

MODEL_DIR = REPO_ROOT / "engines" / "tiny-policy"
CODING = REPO_ROOT / "environments" / "coding" / "coding_env" / "data" / "coding.jsonl"
LINES = [
    {"task_id": "repo-a", "mode": "reference", "turns": ["first <tool_call>x</tool_call>", "submit"]},
    {"task_id": "repo-a", "mode": "wrong", "turns": ["oops"]},
    {"task_id": "repo-b", "mode": "reference", "turns": ["b only"]},
]


@pytest.fixture(scope="module")
def tok() -> SimTokenizer:
    return SimTokenizer(MODEL_DIR)


def _write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _play(
    policy: ScriptedPolicy, tok: SimTokenizer, task_id: str, turns: int, rid: str = "r/g0/0"
) -> list[str]:
    """Play ``turns`` turns of one episode; returns each turn's text (the end token checked and cut)."""
    text = tok.render_chat([{"role": "user", "content": f"Task id: {task_id}\nFix it."}], True)
    ids, out = tok.encode(text), []
    for n in range(turns):
        turn = policy.turn(PolicyRequest(ids, f"{rid}/{n}/1", temperature=1.0, seed=None))
        assert turn.token_ids[-1] == tok.eos_id and len(turn.logprobs) == len(turn.token_ids)
        out.append(tok.decode(turn.token_ids[:-1]))
        ids = ids + turn.token_ids + tok.encode("<|tool|>ok<|end|><|assistant|>")
    return out


def test_transcripts_play_in_order_the_last_turn_repeats_and_modes_follow_the_rules(
    tmp_path: Path, tok: SimTokenizer
) -> None:
    path = _write(tmp_path / "t.jsonl", LINES)
    rules = [ModeRule.parse("request:bad/=wrong")]
    settings = SimSettings(transcripts=path, mode_rules=rules)
    policy = make_policy(settings, tok)
    assert isinstance(policy, ScriptedPolicy)
    assert _play(policy, tok, "repo-a", 3) == ["first <tool_call>x</tool_call>", "submit", "submit"]
    assert _play(policy, tok, "repo-a", 2, rid="bad/g0/0") == ["oops", "oops"]
    assert _play(policy, tok, "repo-b", 1) == ["b only"]


def test_transcripts_take_precedence_and_scripted_tasks_still_play_beside_them(
    tmp_path: Path, tok: SimTokenizer
) -> None:
    coding = load_scripted_tasks(CODING)[0]
    lines = [*LINES, {"task_id": coding.id, "mode": "reference", "turns": ["scripted elsewhere"]}]
    other = load_scripted_tasks(CODING)[1]
    policy = make_policy(SimSettings(tasks=CODING, transcripts=_write(tmp_path / "t.jsonl", lines)), tok)
    assert _play(policy, tok, coding.id, 1) == ["scripted elsewhere"]
    assert _play(policy, tok, other.id, 2) == script(other, Mode.REFERENCE)[:2]


def test_requests_no_transcript_covers_are_policy_errors(tmp_path: Path, tok: SimTokenizer) -> None:
    settings = SimSettings(transcripts=_write(tmp_path / "t.jsonl", LINES), mode=Mode.LOOP)
    policy = make_policy(settings, tok)
    with pytest.raises(PolicyError, match="task 'repo-a' has no loop transcript"):
        _play(policy, tok, "repo-a", 1)
    with pytest.raises(PolicyError, match="unknown task id 'repo-zzz'"):
        _play(policy, tok, "repo-zzz", 1)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ({"task_id": "a", "mode": "sideways", "turns": ["x"]}, r"t\.jsonl:2: field 'mode'"),
        ({"task_id": "a", "mode": "wrong", "turns": []}, r"t\.jsonl:2: field 'turns'"),
        ({"task_id": "a", "mode": "wrong", "turns": [1]}, r"t\.jsonl:2: field 'turns'"),
        ({"task_id": "", "mode": "wrong", "turns": ["x"]}, r"t\.jsonl:2: field 'task_id'"),
        ({"task_id": "a", "mode": "wrong", "turns": ["x"], "extra": 1}, r"t\.jsonl:2: field 'extra'"),
        ({"task_id": "repo-a", "mode": "reference", "turns": ["x"]}, r"t\.jsonl:2: field 'mode'.*already"),
    ],
)
def test_bad_transcript_lines_name_file_line_and_field(tmp_path: Path, line: dict, error: str) -> None:
    path = _write(tmp_path / "t.jsonl", [LINES[0], line])
    with pytest.raises(TaskFileError, match=error) as info:
        load_transcripts(path)
    assert "\n" not in str(info.value)


def test_the_scripted_policy_needs_tasks_or_transcripts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"coding task file .* or a transcripts file"):
        SimSettings(tasks=None)
    assert SimSettings(transcripts=_write(tmp_path / "t.jsonl", LINES)).tasks is None
    with pytest.raises(TaskFileError, match="no transcripts"):
        load_transcripts(_write(tmp_path / "empty.jsonl", []))
