"""The run's circuit breaker on the time-skipping server: consecutive infra failures of one kind pause
admission (a probe group every breaker_probe_s) instead of burning through the task list; a probe that
succeeds resumes it."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from durable_rollouts.config.models import Config, RolloutConfig, RunConfig
from durable_rollouts.contracts.activity_io import GenerateInput
from durable_rollouts.contracts.types import RunInput, RunProgress
from durable_rollouts.workflows.run import RunWorkflow

from .fakes import Fakes, fake_worker


def breaker_config(groups: int) -> Config:
    return Config(
        run=RunConfig(num_groups=groups, group_size=2, max_inflight_groups=1, breaker_failures=3,
                      breaker_probe_s=60.0),
        rollout=RolloutConfig(max_turns=1, infra_retries=0),  # every failure counts once (no fresh attempt)
    )  # fmt: skip


def failing_first(fakes: Fakes, n: int) -> None:
    """The first ``n`` model calls fail for good, as infra (the engine rejects them)."""

    async def hook(inp: GenerateInput) -> None:
        if len(fakes.calls["generate_turn"]) <= n:
            raise ApplicationError("backend down", type="EngineBadRequest", non_retryable=True)

    fakes.generate_hook = hook


async def run(client: Client, fakes: Fakes, inp: RunInput, uid: str) -> tuple[RunProgress, float]:
    tq = f"tq-{uid}"
    async with fake_worker(client, tq, fakes):
        handle = await client.start_workflow(RunWorkflow.run, inp, id=inp.run_id, task_queue=tq)
        result: RunProgress = await handle.result()
        desc = await handle.describe()
    assert desc.close_time is not None
    return result, (desc.close_time - desc.start_time).total_seconds()


async def test_the_breaker_opens_probes_and_closes(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    fakes.done_on_turn = 1
    failing_first(fakes, 4)  # groups 0 and 1 fail whole: 4 >= 3 consecutive EngineBadRequest
    inp = RunInput(run_id=f"run-{uid}", config=breaker_config(groups=5))
    result, took_s = await run(ts_client, fakes, inp, uid)
    assert result.done and result.groups_done == 5
    assert result.outcomes == {"failed": 4, "completed": 6}
    assert result.breaker_opened == 1 and result.breaker is None  # the probe (group 2) succeeded
    assert took_s >= 60.0  # admission waited for the probe time, once


async def test_while_failures_go_on_only_probes_run(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    failing_first(fakes, 10_000)
    inp = RunInput(run_id=f"run-{uid}", config=breaker_config(groups=6))
    result, took_s = await run(ts_client, fakes, inp, uid)
    assert result.done and result.outcomes == {"failed": 12}
    assert result.breaker_opened == 1 and result.breaker is not None and "EngineBadRequest" in result.breaker
    # Groups 0 and 1 trip it; each of the other 4 is a probe, 60 s after the one before failed.
    assert took_s >= 4 * 60.0


async def test_no_breaker_burns_through_the_list(ts_client: Client, uid: str) -> None:
    fakes = Fakes()
    failing_first(fakes, 10_000)
    cfg = breaker_config(groups=6)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"breaker_failures": None})})
    result, took_s = await run(ts_client, fakes, RunInput(run_id=f"run-{uid}", config=cfg), uid)
    assert result.outcomes == {"failed": 12} and result.breaker_opened == 0 and took_s < 60.0
