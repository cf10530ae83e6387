"""The environment boundary (``environments.base.calling``) and how a failure's reason names its cause."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from durable_rollouts.environments import registry
from durable_rollouts.environments.base import Environment, Prompt, Step, Task, TurnContext, calling
from durable_rollouts.errors import (
    EnvironmentCodeError,
    EnvironmentFailure,
    SandboxGone,
    SandboxNotReady,
    TaskFileError,
    failure_details,
    failure_kind,
    failure_reason,
)


class VerifierBusy(EnvironmentFailure):
    """An environment's own transient failure."""

    retryable = True


class Env(Environment):
    name = "boundary-test"
    env_version = verifier_version = "test"
    retryable_errors = (ConnectionError,)

    def prompt(self, task: Task) -> Prompt:
        return Prompt(token_ids=[1])

    def parse(self, ctx: TurnContext, text: str) -> Step:
        return Step(done=True, reward=1 / 0)


def _through(exc: BaseException, hook: str = "parse") -> BaseException:
    with pytest.raises(BaseException) as caught, calling(Env(), hook, "run/g/0"):
        raise exc
    return caught.value


def test_an_exception_of_the_environment_code_becomes_a_final_environment_failure_with_its_frames() -> None:
    ctx = TurnContext(task=Task(id="t"), rollout_id="run/g/0", turn=0, last_turn=True)
    with pytest.raises(EnvironmentCodeError) as caught, calling(Env(), "parse", ctx.rollout_id):
        Env().parse(ctx, "x")
    e = caught.value
    assert str(e) == "ZeroDivisionError: division by zero" and not e.retryable and e.kind == "environment"
    assert e.hook == "parse" and "in parse: return Step(done=True, reward=1 / 0)" in e.frames[-1]
    assert isinstance(e.__cause__, ZeroDivisionError)
    app = e.to_application_error()
    assert app.type == "EnvironmentCodeError" and app.non_retryable
    assert failure_kind(app) == "environment"
    assert failure_reason(app) == "environment: ZeroDivisionError: division by zero"
    assert failure_details(app) == {"type": "ZeroDivisionError", "hook": "parse", "frames": e.frames}


def test_what_the_environment_declares_transient_is_retryable() -> None:
    declared = _through(ConnectionResetError("verifier down"))
    assert isinstance(declared, EnvironmentCodeError) and declared.retryable
    own = _through(VerifierBusy("queue full"))
    assert isinstance(own, EnvironmentCodeError) and own.retryable and str(own) == "VerifierBusy: queue full"
    assert not own.to_application_error().non_retryable


@pytest.mark.parametrize(
    "exc", [SandboxGone("container died"), SandboxNotReady("daemon"), TaskFileError("t.jsonl:3: bad")]
)
def test_the_projects_own_errors_raised_inside_a_hook_keep_their_class(exc: Exception) -> None:
    assert _through(exc, "act") is exc


def test_an_environment_failure_raised_on_purpose_passes_as_it_is() -> None:
    e = EnvironmentFailure("setup failed")
    assert _through(e, "sandbox") is e
    app = e.to_application_error()
    assert failure_reason(app) == "environment: EnvironmentFailure: setup failed"
    assert failure_details(app) is None


def test_cancellation_is_not_an_environment_failure() -> None:
    import asyncio

    cancelled = asyncio.CancelledError()
    assert _through(cancelled) is cancelled


def test_infra_reasons_keep_the_class_name() -> None:
    app = ApplicationError("refused", type="EngineUnavailable")
    assert failure_reason(app) == "infra: EngineUnavailable: refused" and failure_details(app) is None
    unknown = ApplicationError("boom", type="ZeroDivisionError")  # raised outside any hook: infrastructure
    assert failure_reason(unknown) == "infra: ZeroDivisionError: boom"


class BrokenLoad(Env):
    name = "broken-load"

    def load_tasks(self, path: object) -> list[Task]:
        return [Task(id=str(n)) for n in range(3)][:: len(str(path)) - len(str(path))]


def test_a_load_tasks_that_raises_at_submit_is_one_line_naming_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from durable_rollouts.cli.rollouts import app

    eps = {
        **registry.installed(),
        "broken-load": EntryPoint("broken-load", f"{__name__}:BrokenLoad", registry.GROUP),
    }
    monkeypatch.setattr(registry, "installed", lambda: eps)
    registry.get.cache_clear()
    try:
        args = ["run", "--set", 'run.env="broken-load"', "--set", f"store.url={json.dumps(str(tmp_path))}"]
        result = CliRunner().invoke(app, args)
    finally:
        registry.get.cache_clear()
    assert result.exit_code == 3
    assert (
        result.output.strip()
        == "error: run.env 'broken-load': load_tasks raised ValueError: slice step cannot be zero"
    )
