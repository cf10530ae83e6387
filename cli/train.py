"""`rollouts train CONFIG`: the closed GRPO loop on the running stack (see trainer/loop.py).

Invariant: a thin view of :class:`trainer.loop.Loop`. A bad config, override or starting state prints one
``error: ...`` line and exits 2; an unreachable service exits 1. Heavy imports (torch, temporalio) wait
until the command runs, so ``rollouts --help`` answers at once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from durable_rollouts.config.models import Config
    from durable_rollouts.trainer.settings import TrainerSettings


def _fail(msg: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


def train(
    config: Annotated[Path, typer.Argument(help="Loop config (TOML): run sections plus a trainer section.")],
    run_id: Annotated[
        str | None, typer.Option("--run-id", help="Id of the new run (default: grpo-<time>).")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the metrics JSON here.")] = None,
    groups: Annotated[int | None, typer.Option("--groups", help="Override run.num_groups.")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="section.field=value (trainer.* too)")
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option("--metrics-port", help="Serve the trainer feed's Prometheus metrics (0 = a free port)."),
    ] = None,
) -> None:
    """Generate a run and train on it as it arrives: take fresh groups from the trainer feed, take GRPO steps
    with importance weights from the recorded logprobs, save and publish each new version to the engines;
    math accuracy is measured through the engine before and after."""
    import time

    from durable_rollouts.config.load import ConfigError
    from durable_rollouts.config.paths import resolve_path, rollouts_home
    from durable_rollouts.environments.tasks import load_tasks
    from durable_rollouts.errors import TaskFileError
    from durable_rollouts.trainer.settings import load_loop_config

    overrides = list(set_ or [])
    if groups is not None:
        overrides.append(f"run.num_groups={groups}")
    try:
        cfg, ts = load_loop_config(config, overrides)
    except ConfigError as e:
        raise _fail(str(e)) from None
    from durable_rollouts.environments import registry

    try:
        env = registry.get(cfg.run.env)
    except ConfigError as e:
        raise _fail(f"{config}: {e}") from None
    if not env.inline_steps:  # its evaluation scores one sampled turn, with no sandbox
        raise _fail(
            f"{config}: run.env: the example trainer evaluates inline-step runs (math), not {cfg.run.env!r}"
        )
    tasks_path = resolve_path(cfg.run.task_file, "run.task_file")
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"task_file": str(tasks_path)})})
    try:
        load_tasks(tasks_path, cfg.run.env)
        load_tasks(resolve_path(ts.eval_task_file, "trainer.eval_task_file"), cfg.run.env)
    except TaskFileError as e:
        raise _fail(str(e)) from None
    rid = run_id or time.strftime("grpo-%Y%m%d-%H%M%S")
    from durable_rollouts.metrics.serve import serve_metrics

    with serve_metrics(metrics_port) as port:  # feed freshness, discards, tokens consumed (metrics/)
        if port is not None:
            typer.echo(f"trainer metrics on http://127.0.0.1:{port}/metrics", err=True)
        metrics = _run(cfg, ts, rid, rollouts_home())
    if out is not None:
        from durable_rollouts.trainer.loop import write_metrics

        write_metrics(metrics, out)
        typer.echo(f"metrics: {out}")
    _summary(metrics)


def _run(cfg: Config, ts: TrainerSettings, rid: str, home: Path) -> dict[str, Any]:
    from durable_rollouts.engines.policy import PolicyError
    from durable_rollouts.trainer.batch import BatchError
    from durable_rollouts.trainer.loop import Loop, TrainerError
    from durable_rollouts.trainer.policy_io import PolicyIOError

    loop = Loop(cfg, ts, rid, home, log=lambda line: typer.echo(line, err=True))
    try:
        return asyncio.run(loop.run())
    except TrainerError as e:
        raise _fail(str(e), 1) from None
    except (PolicyError, PolicyIOError, BatchError) as e:
        raise _fail(str(e), 1) from None


def _summary(m: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GRPO loop {m['run_id']}", show_header=False)
    a0, a1 = m["accuracy_start"], m["accuracy_end"]
    if a0 and a1:
        delta = f"{m['accuracy_delta_points']:+.1f} points, {a1['samples']} samples each"
        table.add_row("math accuracy", f"{a0['accuracy']:.3f} -> {a1['accuracy']:.3f} ({delta})")
    table.add_row("steps / versions", f"{m['steps']} ({', '.join(m['versions'][-3:])} last)")
    table.add_row("loop wall time", f"{m['loop_wall_s']:.1f} s")
    table.add_row("token lag (tokens)", str(m["freshness"]["token_lag"]))
    table.add_row("discard rate (records)", f"{m['discard_rate_records']} {m['discards_by_reason']}")
    table.add_row("trainer idle (wait) ratio", str(m["trainer_time"]["idle_ratio"]))
    table.add_row("generated tokens reaching an update", str(m["tokens_reaching_update"]))
    led = m["ledger"]
    table.add_row("books (records)", " ".join(f"{k} {v['records']}" for k, v in led.items()))
    Console().print(table)
