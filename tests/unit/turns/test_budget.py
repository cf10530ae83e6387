"""The token budget of a model call and the truncation verdicts (turns/budget.py), and that nothing else
computes them: the rollout workflow, the model call, the engine client, reproduce and the benchmarks'
bare loop call the one function (before turns/ they computed it in four places, and decided truncation in
three)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from durable_rollouts.contracts.types import TruncationReason
from durable_rollouts.turns.budget import Budget, turn_budget, turn_truncation
from tests import REPO_ROOT
from tests.unit.test_architecture import PACKAGES

TOKEN_BUDGET, CONTEXT_LENGTH = TruncationReason.TOKEN_BUDGET, TruncationReason.CONTEXT_LENGTH


@pytest.mark.parametrize(
    ("context", "total", "max_tokens", "window", "expected"),
    [
        (10, 100, 8, None, Budget(8)),  # sampling.max_tokens caps the call
        (95, 100, 8, None, Budget(5)),  # what the rollout's token limit leaves caps it
        (99, 100, 8, None, Budget(1)),
        (100, 100, 8, None, Budget(0, TOKEN_BUDGET)),  # the prompt alone fills the limit: no call
        (120, 100, 8, None, Budget(0, TOKEN_BUDGET)),
        (500, 0, 8, None, Budget(8)),  # 0: no limit beyond max_tokens
        (10, 100, 8, 14, Budget(4)),  # the engine's window caps it
        (14, 100, 8, 14, Budget(0, CONTEXT_LENGTH)),  # the window is full: context_length
        (100, 100, 8, 50, Budget(0, TOKEN_BUDGET)),  # the rollout's own limit is named first
        (10, 0, 0, None, Budget(0, TOKEN_BUDGET)),
    ],
)
def test_turn_budget(context: int, total: int, max_tokens: int, window: int | None, expected: Budget) -> None:
    assert turn_budget(context, total, max_tokens, window) == expected


def test_turn_truncation_only_for_a_turn_that_stopped_for_length_at_the_limit() -> None:
    assert turn_truncation("length", 100, 100) == TOKEN_BUDGET
    assert turn_truncation("length", 120, 100) == TOKEN_BUDGET
    assert turn_truncation("length", 99, 100) is None  # max_tokens stopped it: the env steps it
    assert turn_truncation("stop", 100, 100) is None  # it ended on its own exactly at the limit
    assert turn_truncation("length", 100, 0) is None  # no limit


def _sources() -> list[Path]:
    return [f for p in [*PACKAGES, "bench"] for f in sorted((REPO_ROOT / p).rglob("*.py"))]


LIMITS = {"max_total_tokens", "max_model_len"}
NOT_A_TURN = {
    "simengine/engine.py": "the simulated engine's own window (the server's side, as vLLM's)",
    "bench/stale_queue_workload.py": "a synthetic workload's output lengths, drawn to fit the window",
    "gateway/response_items.py": "an answer already stored, put in the Responses API's terms (a choice that "
    "stopped for length is an incomplete response): the wire format, not a turn's verdict",
}
"""Files that subtract a length from a limit for another purpose than a turn's budget."""


def _identifiers(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def _limit_minus_length(n: ast.AST, limits: set[str]) -> bool:
    """``n`` subtracts something other than a constant from an expression naming a token limit."""
    if not (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub)):
        return False
    return not isinstance(n.right, ast.Constant) and bool(_identifiers(n.left) & limits)


def budget_copies(text: str, where: str) -> list[str]:
    """Places in ``text`` that compute a turn's budget or truncation verdict themselves: a token limit
    minus a length (``max_total_tokens - n``, ``max_model_len - len(...)``, or a name assigned a
    ``max_model_len`` minus a length), or a finish reason (``x.finish_reason``, ``meta["finish_reason"]``)
    compared with "length"."""
    tree = ast.parse(text)
    limit_names = {  # e.g. ``limit = await self.max_model_len(...)``
        t.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and LIMITS & _identifiers(n.value)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    hits = []
    for n in ast.walk(tree):
        if _limit_minus_length(n, LIMITS | limit_names):
            hits.append(f"{where}:{n.lineno}: {ast.unparse(n)}")
        if isinstance(n, ast.Compare):
            keys = {c.value for c in ast.walk(n.left) if isinstance(c, ast.Constant)}
            if "finish_reason" in _identifiers(n.left) | keys and any(
                isinstance(c, ast.Constant) and c.value == "length" for c in n.comparators
            ):
                hits.append(f"{where}:{n.lineno}: {ast.unparse(n)}")
    return hits


def test_only_the_turn_module_computes_a_budget_or_a_truncation_verdict() -> None:
    own = REPO_ROOT / "turns" / "budget.py"
    assert budget_copies(own.read_text(), "turns/budget.py"), "the check must see what it allows"
    files = [(f, str(f.relative_to(REPO_ROOT))) for f in _sources() if f != own]
    hits = [h for f, where in files if where not in NOT_A_TURN for h in budget_copies(f.read_text(), where)]
    assert not hits, "a turn's budget or truncation computed outside turns/budget.py:\n" + "\n".join(hits)


def test_the_check_finds_each_copy_the_turn_module_replaced() -> None:
    """The four budget computations and the truncation verdicts as they were before turns/ (cb3230d)."""
    copies = {
        "workflow.py": "budget = inp.max_total_tokens - s.tokens\n"
        "if turn.finish_reason == 'length' and turn.end >= inp.max_total_tokens: pass\n",
        "activity.py": "room = inp.max_total_tokens - len(context) if inp.max_total_tokens else 0\n"
        "over_budget = seg.meta['finish_reason'] == 'length' and seg.end >= limit\n",
        "client.py": "async def f(self):\n    limit = await self.max_model_len(u, m)\n"
        "    room = limit - len(prompt_ids)\n",
        "reproduce.py": "budget = cfg.rollout.max_total_tokens - len(prompt.token_ids)\n",
    }
    found = {name: len(budget_copies(text, name)) for name, text in copies.items()}
    assert found == {"workflow.py": 2, "activity.py": 2, "client.py": 1, "reproduce.py": 1}


@pytest.mark.parametrize(
    ("module", "calls"),
    [
        ("turns/sequence.py", {"turn_budget", "turn_truncation"}),  # a rollout's turns (workflow or batch)
        ("turns/model.py", {"turn_budget", "turn_truncation"}),
        ("engines/client.py", {"turn_budget"}),
        ("cli/reproduce.py", {"call_model"}),
        ("bench/harness.py", {"call_model", "turn_truncation"}),
        ("bench/admission_fleet.py", {"turn_budget", "turn_truncation"}),
    ],
)
def test_the_former_copies_call_the_one_function(module: str, calls: set[str]) -> None:
    tree = ast.parse((REPO_ROOT / module).read_text())
    called = {
        n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
    }
    assert calls <= called, f"{module} calls {sorted(calls - called)} no more"
