"""Failures labelled by cause, on the time-skipping server with the real workers' activities (a fake engine
and an in-memory sandbox backend underneath): an exception in an environment's own code is recorded
``environment: <Type>: <message>`` after one attempt, its last frames kept with the record, while the
group's other members are scored; the project's own sandbox errors raised inside ``act`` stay infra."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from temporalio.client import Client

from durable_rollouts.config.models import Config
from durable_rollouts.contracts.types import EnvTraits, GroupInput, GroupResult, Outcome
from durable_rollouts.engines.client import Generation
from durable_rollouts.environments import registry
from durable_rollouts.environments.base import (
    Action,
    Environment,
    Prompt,
    SandboxPlan,
    Step,
    Task,
    TurnContext,
)
from durable_rollouts.errors import SandboxPathError
from durable_rollouts.sandboxes.base import ExecResult, SandboxHandle, SandboxInfo, SandboxSpec
from durable_rollouts.store import RunStore
from durable_rollouts.workers.worker import build_worker
from durable_rollouts.workflows.group import GroupWorkflow

from .fakes import rollout_input

PARSES: Counter[str] = Counter()
"""Calls of a test environment's ``parse`` per rollout id (one attempt = one call)."""
ACTS: Counter[str] = Counter()


def _member(ctx: TurnContext) -> int:
    """The member's slot (a slot's later attempt ``<i>r<n>`` answers as slot i)."""
    return int(ctx.rollout_id.rsplit("/", 1)[1].partition("r")[0])


class BrokenParse(Environment):
    """Member 1's ``parse`` divides by zero; member 0 is right (reward 1), member 2 wrong (reward 0)."""

    name = "broken-parse"
    env_version = verifier_version = "test"
    inline_steps = True

    def prompt(self, task: Task) -> Prompt:
        return Prompt(messages=[{"role": "user", "content": "2+2"}])

    def parse(self, ctx: TurnContext, text: str) -> Step:
        PARSES[ctx.rollout_id] += 1
        if _member(ctx) == 1:
            return Step(done=True, reward=1 / (_member(ctx) - 1))
        return Step(done=True, reward=1.0 if _member(ctx) == 0 else 0.0)


class FlakyParse(BrokenParse):
    """Member 1's first ``parse`` times out, a type the environment declares transient: retried."""

    name = "flaky-parse"
    retryable_errors = (TimeoutError,)

    def parse(self, ctx: TurnContext, text: str) -> Step:
        if _member(ctx) != 1:
            return super().parse(ctx, text)
        PARSES[ctx.rollout_id] += 1
        if PARSES[ctx.rollout_id] == 1:
            raise TimeoutError("the remote verifier did not answer")
        return Step(done=True, reward=0.5)


class SandboxedNoAct(Environment):
    """Every turn is an action run in the sandbox; member 1's falls through to the base class's ``act``
    (NotImplementedError), member 3's sandbox rejects the path (SandboxPathError, the sandbox's own)."""

    name = "sandboxed-no-act"
    env_version = verifier_version = "test"
    uses_sandbox = True

    def prompt(self, task: Task) -> Prompt:
        return Prompt(messages=[{"role": "user", "content": "ls"}])

    def sandbox(self, task: Task, default: SandboxSpec) -> SandboxPlan:
        return SandboxPlan(spec=default)

    def parse(self, ctx: TurnContext, text: str) -> Action:
        PARSES[ctx.rollout_id] += 1
        return {"cmd": "ls"}

    async def act(self, ctx: TurnContext, action: Action) -> Step:
        ACTS[ctx.rollout_id] += 1
        if _member(ctx) == 1:
            return await super().act(ctx, action)
        assert ctx.sandbox is not None
        if _member(ctx) == 3:
            await ctx.sandbox.read_file("../etc/passwd")
        await ctx.sandbox.exec(action["cmd"])
        return Step(done=True, reward=1.0 if _member(ctx) == 0 else 0.0)


class FakeEngine:
    """The engine client's calls the activities make, without an engine: every turn samples 3 tokens."""

    async def logprob_mode(self, base_url: str) -> str | None:
        return None

    async def tokenize_chat(self, base_url: str, model: str, messages: list[dict[str, str]]) -> list[int]:
        return [1, 2, 3]

    async def detokenize(self, base_url: str, model: str, token_ids: list[int]) -> str:
        return "4<|end|>"

    async def generate(self, base_url: str, model: str, prompt_ids: list[int], *args: object) -> Generation:
        return Generation([7, 8, 9], [-0.1] * 3, [None] * 3, "stop", 0.01, 0.0)


class MemorySandboxes:
    """An AsyncSandboxBackend in memory: containers are names; ``read_file`` refuses ``..`` paths."""

    ids = itertools.count()

    async def create(self, key: str, run_id: str, spec: SandboxSpec) -> SandboxHandle:
        n = next(self.ids)
        return SandboxHandle(key=key, run_id=run_id, name=f"sb-{n}", container_id=f"c{n}", spec=spec)

    async def exec(
        self,
        handle: SandboxHandle,
        cmd: str,
        timeout_s: float | None = None,
        once_key: str | None = None,
        user: str | None = None,
    ) -> ExecResult:
        return ExecResult(exit_code=0, output="")

    async def write_file(self, handle: SandboxHandle, path: str, content: bytes | str) -> None:
        return None

    async def read_file(self, handle: SandboxHandle, path: str, max_bytes: int = 1 << 20) -> bytes:
        raise SandboxPathError(f"rejected path {path!r}: leaves the workdir")

    async def destroy(self, key: str) -> None:
        return None

    async def list_containers(self, run_id: str | None = None) -> list[SandboxInfo]:
        return []  # nothing outlives its destroy here

    async def host(self) -> str | None:
        return "memory"


@pytest.fixture(autouse=True)
def test_environments(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test environments, registered as a plug-in package would register them (entry points)."""
    installed = registry.installed()
    for cls in (BrokenParse, FlakyParse, SandboxedNoAct):
        value = f"{__name__}:{cls.__name__}"
        installed[cls.name] = EntryPoint(name=cls.name, value=value, group=registry.GROUP)
    monkeypatch.setattr(registry, "installed", lambda: installed)
    registry.get.cache_clear()
    yield
    registry.get.cache_clear()


async def run_group(client: Client, store: RunStore, uid: str, env: EnvTraits, size: int) -> GroupResult:
    run_id = f"run-{uid}"
    store.register_run(run_id, Config().model_dump_json(), "test-hash")
    store.put_tasks(run_id, [{"id": "task-0"}])
    template = rollout_input(uid, env=env, sandbox=SandboxSpec() if env.uses_sandbox else None)
    inp = GroupInput(
        run_id=run_id, group_id="g000000", task_id="task-0", size=size, advantage_eps=1e-6, template=template
    )
    worker = build_worker(client, f"tq-{uid}", store, FakeEngine(), sandboxes=MemorySandboxes)  # type: ignore[arg-type]
    async with worker:
        result: GroupResult = await client.execute_workflow(
            GroupWorkflow.run, inp, id=f"{run_id}/g000000", task_queue=f"tq-{uid}"
        )
    return result


def records(store: RunStore, uid: str) -> dict[int, dict]:
    return {int(r["rollout_id"].rsplit("/", 1)[1]): r for r in store.rollouts(f"run-{uid}")}


def assert_environment_failure(rec: dict, reason: str, hook: str) -> None:
    assert rec["outcome"] == Outcome.FAILED.value and not rec["scorable"] and rec["reward"] is None
    assert rec["reason"] == reason
    failure = json.loads(rec["extra_json"])["failure"]
    assert failure["type"] == reason.split(": ")[1] and failure["hook"] == hook
    assert failure["frames"] and f"in {hook}:" in failure["frames"][-1], failure["frames"]
    assert any(Path(__file__).name in f for f in failure["frames"]), "the frames name the environment's code"


async def test_a_parse_that_raises_fails_as_environment_once_and_the_others_are_scored(
    ts_client: Client, uid: str, tmp_path: Path
) -> None:
    store = RunStore(tmp_path)
    env = EnvTraits(name="broken-parse", inline_steps=True)
    result = await run_group(ts_client, store, uid, env, size=3)

    recs = records(store, uid)
    run = f"run-{uid}/g000000"
    assert_environment_failure(recs[1], "environment: ZeroDivisionError: division by zero", "parse")
    assert PARSES[f"{run}/1"] == 1, "an exception of the environment's code is not retried"
    assert [recs[i]["outcome"] for i in (0, 2)] == ["completed", "completed"]
    assert (recs[0]["reward"], recs[2]["reward"]) == (1.0, 0.0)
    assert (result.scorable, result.failed, result.reward_mean) == (2, 1, 0.5)
    assert result.infra_failures == {}, "an environment failure is not an infra failure (breaker)"
    assert recs[1]["advantage"] is None and recs[0]["advantage"] == pytest.approx(-recs[2]["advantage"])


async def test_an_action_without_act_in_a_sandboxed_environment_fails_as_environment(
    ts_client: Client, uid: str, tmp_path: Path
) -> None:
    store = RunStore(tmp_path)
    env = EnvTraits(name="sandboxed-no-act", uses_sandbox=True)
    result = await run_group(ts_client, store, uid, env, size=4)

    recs = records(store, uid)
    run = f"run-{uid}/g000000"
    reason = "environment: NotImplementedError: environment sandboxed-no-act has no actions"
    assert_environment_failure(recs[1], reason, "act")
    assert ACTS[f"{run}/1"] == 1, "an exception of the environment's code is not retried"
    # The sandbox's own error raised inside act stays the sandbox's (infra), with no environment details.
    assert recs[3]["outcome"] == "failed" and recs[3]["reason"].startswith("infra: SandboxPathError: ")
    assert "failure" not in json.loads(recs[3]["extra_json"])
    assert [recs[i]["reward"] for i in (0, 2)] == [1.0, 0.0]
    assert (result.scorable, result.failed, result.reward_mean) == (2, 2, 0.5)
    assert result.infra_failures == {"SandboxPathError": 1}


async def test_an_exception_the_environment_declares_transient_is_retried(
    ts_client: Client, uid: str, tmp_path: Path
) -> None:
    store = RunStore(tmp_path)
    result = await run_group(ts_client, store, uid, EnvTraits(name="flaky-parse", inline_steps=True), size=2)

    recs = records(store, uid)
    assert PARSES[f"run-{uid}/g000000/1"] == 2
    assert (recs[1]["outcome"], recs[1]["reward"]) == ("completed", 0.5)
    assert (result.scorable, result.failed) == (2, 0)
