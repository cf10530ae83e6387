"""The ``rollouts`` command: run, status, export, worker, stack (the operating commands are in
``cli.operate``, the shared helpers in ``cli.common``, the other sub-commands in their own modules).

Invariant: user mistakes (config, task file, run id) print one line starting with ``error:`` and exit 2;
an unreachable service prints one line and exits 1; ``run --wait`` on a run whose environment failures
exceed ``run.max_environment_failure_share`` prints one line and exits 3; Ctrl-C ends a command within
``interrupt.GRACE_S`` (but ``stack up`` and ``worker``, which clean up first) with exit 130 and no traceback
(``stack.interrupt``, installed before anything else is imported). Heavy imports happen inside commands,
so ``--help`` answers at once.
"""

from __future__ import annotations

import os
import sys

from durable_rollouts.stack import interrupt

if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "rollouts":  # the program, not an importer
    interrupt.install()  # first: Ctrl-C during the imports below returns at once too (stack/interrupt.py)

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from durable_rollouts.cli.common import CONNECTION_FLAGS, fail, run_store, temporal_client, temporal_options

if TYPE_CHECKING:
    from durable_rollouts.config.temporal import Connection

# Help texts print as written: no rich markup, which took `[stack]` in "a [stack] table" for a style and
# dropped it. Set here, on the root, it holds for every sub-command and sub-app (typer passes it down).
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Durable rollout generation for agent RL.",
)

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _new_run_id() -> str:
    import secrets
    import time

    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


@app.command()
@temporal_options
def run(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="Run config: a TOML file, or a bundled example (math, coding, ...); defaults when omitted."
        ),
    ] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Run id (existing: attach).")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Show progress and a summary to the end.")] = False,
    task_file: Annotated[str | None, typer.Option("--task-file", help="Override run.task_file.")] = None,
    groups: Annotated[int | None, typer.Option("--groups", help="Override run.num_groups.")] = None,
    group_size: Annotated[int | None, typer.Option("--group-size", help="Override run.group_size.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="section.field=value")] = None,
    conn: Connection | None = None,
) -> None:
    """Start a run (or attach to an existing run id) and print its id."""
    from durable_rollouts.config.load import ConfigError, config_hash, load_config
    from durable_rollouts.config.paths import resolve_path
    from durable_rollouts.environments.tasks import load_tasks
    from durable_rollouts.errors import EnvironmentCodeError, TaskFileError

    overrides = list(set_ or [])
    if task_file is not None:
        overrides.append(f"run.task_file={_toml_str(task_file)}")
    if groups is not None:
        overrides.append(f"run.num_groups={groups}")
    if group_size is not None:
        overrides.append(f"run.group_size={group_size}")
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise fail(str(e)) from None
    tasks_path = resolve_path(cfg.run.task_file, "run.task_file")
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"task_file": str(tasks_path)})})
    try:
        tasks = load_tasks(tasks_path, cfg.run.env, cfg.sandbox)
    except TaskFileError as e:
        raise fail(str(e)) from None
    except EnvironmentCodeError as e:  # a bug in the environment's code: its failure, exit 3
        raise fail(f"run.env {cfg.run.env!r}: load_tasks raised {e}", 3) from None
    rid = run_id or _new_run_id()
    if not RUN_ID_RE.match(rid):
        raise fail(f"--run-id {rid!r}: use letters, digits, '.', '_' and '-' (at most 128)")
    # Uploaded before the run starts, once a worker can take it: its workers read the tasks from the store,
    # not from this host's file (an existing run keeps the tasks it has).
    upload = lambda: run_store(cfg.store.url).put_tasks(rid, tasks)  # noqa: E731
    flags = conn.given() if conn else {}
    asyncio.run(_submit(cfg, config_hash(cfg), rid, wait, upload, cfg.temporal.connection(**flags)))


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


async def _submit(
    cfg, cfg_hash: str, rid: str, wait: bool, upload: Callable[[], object], conn: Connection | None = None
) -> None:
    """Start the run (or attach to it): on its environment's task queue, once a live worker polls it
    (environments/fleet.py; none: one line, exit 2, nothing started or uploaded)."""
    from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
    from temporalio.service import RPCError, RPCStatusCode

    from durable_rollouts.contracts.types import RunInput
    from durable_rollouts.environments.fleet import require_worker
    from durable_rollouts.errors import ConfigError
    from durable_rollouts.workflows.run import RunWorkflow

    client = await temporal_client(conn or cfg.temporal.connection())
    handle = client.get_workflow_handle_for(RunWorkflow.run, rid)
    try:
        await handle.describe()
        attached = True
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise fail(f"run {rid}: {e}", 1) from None
        attached = False
    if not attached:
        try:
            queue = await require_worker(client, cfg.temporal.task_queue, cfg.run.env)
        except ConfigError as e:
            raise fail(str(e)) from None
        except RPCError as e:
            raise fail(f"run {rid}: cannot ask Temporal for workers ({e})", 1) from None
    upload()
    if not attached:
        # USE_EXISTING closes the race with a concurrent submit of the same id: still one run.
        handle = await client.start_workflow(
            RunWorkflow.run,
            RunInput(run_id=rid, config=cfg, config_hash=cfg_hash),
            id=rid,
            task_queue=queue,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
    typer.echo(rid)
    if attached:
        typer.echo(f"attached to existing run {rid} (its stored config applies)", err=True)
    if wait:  # exit 3 past run.max_environment_failure_share (cli.progress.wait_verdict)
        from durable_rollouts.cli.progress import ENVIRONMENT_FAILURE_EXIT, follow, wait_verdict

        store = run_store(cfg.store.url)
        final = await follow(handle, store)
        if final.stopped is not None:  # a streak of environment failures stopped it: not a success
            raise fail(f"run {rid} stopped: {final.stopped}", ENVIRONMENT_FAILURE_EXIT)
        code, line = wait_verdict(store, rid, cfg.run.max_environment_failure_share)
        if code:
            raise fail(line, code)


@app.command()
@temporal_options
def status(
    run_id: str,
    conn: Connection | None = None,
) -> None:
    """Show a run's progress (live from the run workflow, or its final result)."""
    from durable_rollouts.cli.progress import show_status

    async def go() -> None:
        client = await temporal_client(conn)
        await show_status(client, run_id)

    asyncio.run(go())


@app.command()
def export(
    run_id: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="JSONL file to write.")],
) -> None:
    """Write a run's rollout and group records as JSONL (the trainer contract; see README)."""
    from durable_rollouts.records.export import export_run

    store = run_store()
    if store.get_run(run_id) is None:
        raise fail(f"no run {run_id!r} in the store at {store.location}")
    with output.open("w", encoding="utf-8") as fh:
        counts = export_run(store, run_id, fh)
    typer.echo(f"wrote {counts['rollout']} rollouts and {counts['group']} groups to {output}")


@app.command()
def report(
    run_id: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="HTML file to write.")] = Path("report.html"),
) -> None:
    """Write a run's report: one self-contained HTML file of plots (time decomposition, lengths, rewards,
    admission, replicas; see README, "Reports")."""
    from durable_rollouts.records.report import ReportError, write_report
    from durable_rollouts.store import store_exists, store_url

    if not store_exists():
        raise fail(f"no run store at {store_url()} (set ROLLOUTS_STORE or ROLLOUTS_HOME?)")
    try:
        data = write_report(run_store(), run_id, output)
    except ReportError as e:
        raise fail(str(e)) from None
    except OSError as e:
        raise fail(f"{output}: {e.strerror or e}") from None
    typer.echo(f"wrote the report of {len(data.rollouts)} rollouts of run {run_id} to {output}")


@app.command()
@temporal_options
def ledger(
    run_id: str,
    temporal: Annotated[
        bool, typer.Option(help="Also check every RolloutWorkflow of the run has a record.")
    ] = True,
    docker: Annotated[bool, typer.Option(help="Also check no container of the run is left.")] = True,
    conn: Connection | None = None,
) -> None:
    """The ledger check (faults/ledger.py): one line per broken promise; exit 1 on any, 2 on bad input."""
    from durable_rollouts.errors import SandboxError
    from durable_rollouts.faults import LedgerReport, check_run
    from durable_rollouts.sandboxes.pool import SandboxPool

    store = run_store()
    if store.get_run(run_id) is None:
        raise fail(f"run {run_id}: not in the store at {store.location}")

    async def go() -> LedgerReport:
        client = await temporal_client(conn) if temporal else None
        backend = None
        if docker:
            from durable_rollouts.sandboxes import DockerBackend

            try:
                backend = DockerBackend()
            except SandboxError as e:
                raise fail(f"cannot check containers ({e}); use --no-docker", 1) from None
        return await check_run(store, run_id, client=client, backend=backend, pool=SandboxPool(store))

    report = asyncio.run(go())
    for line in report.lines():
        typer.echo(line)
    if not report.ok:
        raise typer.Exit(1)


@app.command()
@temporal_options
def reap(
    run_id: Annotated[str | None, typer.Option("--run-id", help="Only this run's sandboxes.")] = None,
    unknown: Annotated[
        bool,
        typer.Option(
            "--unknown",
            help="Also sandboxes whose rollout this namespace does not know (another deployment's on the "
            "same Docker daemon, or past retention).",
        ),
    ] = False,
    conn: Connection | None = None,
) -> None:
    """Remove sandboxes whose rollout workflow has ended (finished, terminated, timed out)."""
    from durable_rollouts.sandboxes import SandboxError
    from durable_rollouts.sandboxes.pool import SandboxPool
    from durable_rollouts.sandboxes.reaper import reap_orphans
    from durable_rollouts.workers.worker import docker_sandboxes

    async def go() -> list[str]:
        client = await temporal_client(conn)
        pool = SandboxPool(run_store())
        return await reap_orphans(client, docker_sandboxes(), run_id, min_age_s=0, pool=pool, unknown=unknown)

    try:
        removed = asyncio.run(go())
    except SandboxError as e:
        raise fail(str(e), 1) from None
    typer.echo(f"removed {len(removed)} sandboxes" + (f": {', '.join(removed)}" if removed else ""))


policy_app = typer.Typer(no_args_is_help=True, help="Publish policy versions to the engines.")
app.add_typer(policy_app, name="policy")


@policy_app.command("publish")
def policy_publish(
    version: str,
    weights: Annotated[Path, typer.Option("--weights", help="Directory of HF safetensors weights.")],
    engine: Annotated[
        list[str] | None, typer.Option("--engine", help="Engine base URL (repeatable).")
    ] = None,
) -> None:
    """Pause every engine (keeping in-flight requests), reload weights, set the version, reset the prefix
    cache, resume; record the publish in the store. Version ids are immutable."""
    from durable_rollouts.engines.policy import PolicyError, publish

    urls = engine or ["http://127.0.0.1:8000"]
    try:
        rec = publish(urls, version, weights.resolve(), run_store())
    except PolicyError as e:
        raise fail(str(e)) from None
    state = "already published" if rec.already_published else "published"
    typer.echo(f"{version} {state} on {len(rec.engines)} engine(s) (weights {rec.weights_hash[:12]})")


@app.command()
def envs() -> None:
    """List the installed environments (entry-point group durable_rollouts.environments)."""
    from durable_rollouts.environments import registry
    from durable_rollouts.errors import ConfigError

    eps = registry.installed()
    if not eps:
        raise fail("no environments installed")
    for name in sorted(eps):
        try:
            e = registry.get(name)
        except ConfigError as err:
            typer.echo(f"{name:<12} BROKEN  {err}")
            continue
        traits = ", ".join(
            t for t, on in (("sandbox", e.uses_sandbox), ("inline steps", e.inline_steps)) if on
        )
        typer.echo(
            f"{name:<12} {e.env_version} / {e.verifier_version}  {eps[name].value}"
            + (f"  [{traits}]" if traits else "")
        )


@app.command()
@temporal_options
def worker(
    task_queue: Annotated[str, typer.Option(help="Task queue to poll.")] = "rollouts",
    unsandboxed: Annotated[
        bool, typer.Option(help="Run workflow code without the SDK's sandbox (less CPU per workflow task).")
    ] = False,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve rollouts_* metrics on HOST:PORT (SDK metrics on PORT+1).")
    ] = None,
    metrics_host: Annotated[
        str, typer.Option(help="Address the metrics bind (0.0.0.0 in a container scraped over a network).")
    ] = "127.0.0.1",
    store: Annotated[
        str | None,
        typer.Option(
            help="Run store URL (postgresql://..., sqlite:///dir, a directory); default $ROLLOUTS_STORE."
        ),
    ] = None,
    sandbox_host: Annotated[
        str | None, typer.Option(help="Be a sandbox host of this name (sandbox_pool.placement = 'hosts').")
    ] = None,
    docker_host: Annotated[
        str | None, typer.Option(help="The sandbox host's Docker daemon: unix:///..., tcp://... or ssh://...")
    ] = None,
    sandbox_slots: Annotated[int, typer.Option(help="Sandboxes the host runs at once.")] = 8,
    conn: Connection | None = None,
) -> None:
    """Start an additional worker (runs until Ctrl-C or SIGTERM)."""
    from durable_rollouts.workers.worker import main as worker_main

    interrupt.patient()  # it drains on Ctrl-C (its own handler, once running); no watchdog cuts that short

    argv = ["--task-queue", task_queue] + (["--unsandboxed"] if unsandboxed else [])
    for field, value in (conn.given() if conn else {}).items():
        argv += [CONNECTION_FLAGS[field][0], value]
    argv += ["--store", store] if store else []
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port), "--metrics-host", metrics_host]
    if sandbox_host is not None:
        argv += ["--sandbox-host", sandbox_host, "--sandbox-slots", str(sandbox_slots)]
    if docker_host is not None:
        argv += ["--docker-host", docker_host]
    worker_main(argv)


def _mount_runs() -> None:
    from durable_rollouts.cli.runs import runs_command

    app.command("runs")(runs_command)


def _mount_operate() -> None:
    from durable_rollouts.cli.operate import COMMANDS

    for command in COMMANDS:
        app.command()(command)


def _mount_stack() -> None:
    try:
        from durable_rollouts.cli.stack import stack_app
    except ImportError:  # pragma: no cover - only while the stack module is absent
        return
    app.add_typer(stack_app, name="stack", help="Start, stop and inspect the embedded stack.")


def _mount_feed() -> None:
    from durable_rollouts.cli.feed import feed_app

    app.add_typer(feed_app, name="feed")


def _mount_reproduce() -> None:
    from durable_rollouts.cli.reproduce import reproduce_command

    app.command("reproduce")(reproduce_command)


def _mount_chaos() -> None:
    from durable_rollouts.cli.chaos import chaos_command

    app.command("chaos")(chaos_command)


def _mount_train() -> None:
    from durable_rollouts.cli.train import train

    app.command("train")(train)


_mount_runs()
_mount_operate()
_mount_stack()
_mount_feed()
_mount_train()
_mount_reproduce()
_mount_chaos()


def main() -> None:
    from durable_rollouts.stack.procs import run_main

    run_main(lambda: app(prog_name="rollouts"))


if __name__ == "__main__":
    main()
