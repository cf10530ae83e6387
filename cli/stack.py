"""`rollouts stack up|down|status`: run the embedded Temporal + vLLM + worker stack from $ROLLOUTS_HOME.

Invariant: every failure prints one `error: ...` line and exits 2; nothing heavy (temporalio, torch, vLLM) is
imported before the command line is parsed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from durable_rollouts.cli.common import temporal_options

if TYPE_CHECKING:
    from durable_rollouts.config.models import StackConfig
    from durable_rollouts.config.temporal import Connection
    from durable_rollouts.stack.stack import ComponentStatus, StackInfo

stack_app = typer.Typer(
    help="Run the embedded stack: a Temporal dev server, one vLLM engine and one worker.",
    no_args_is_help=True,
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def load_stack_config(path: Path | None) -> StackConfig:
    """The `[stack]` table of a TOML file as a StackConfig (defaults when no file is given).

    Raises:
        typer.Exit: Code 2 after printing one `error: <file>: stack.<field>: <message>` line.
    """
    import tomllib

    from pydantic import ValidationError

    from durable_rollouts.config.models import StackConfig

    if path is None:
        return StackConfig()
    try:
        table = tomllib.loads(path.read_text()).get("stack", {})
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise _fail(f"{path}: {err}") from None
    if not isinstance(table, dict):
        raise _fail(f"{path}: stack: must be a table")
    try:
        return StackConfig.model_validate(table)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in ("stack", *first["loc"]))
        raise _fail(f"{path}: {where}: {first['msg']}") from None


def _print_info(info: StackInfo, detach: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False, box=None)
    table.add_row("temporal", info.temporal_address)
    table.add_row("web UI", info.ui_url)
    table.add_row("engine", f"{info.engine_url}/v1")
    table.add_row("task queue", info.task_queue)
    table.add_row("logs", str(info.log_dir))
    timings = ", ".join(f"{name} {secs:.1f} s" for name, secs in info.ready_s.items())
    console = Console()
    console.print(f"[green]stack up[/green] in {info.home} (healthy after: {timings})")
    console.print(table)
    if not detach:
        console.print("Ctrl-C stops the stack.")


def _print_status(rows: list[ComponentStatus]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("component", "pid", "state", "address", "detail")
    for row in rows:
        state = "[green]healthy[/green]" if row.healthy else "[yellow]unhealthy[/yellow]"
        if not row.alive:
            state = "[dim]stopped[/dim]"
        table.add_row(row.name, str(row.pid or "-"), state, row.address, row.detail)
    Console().print(table)


@stack_app.command()
def up(
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="Return once healthy and leave the stack running.")
    ] = False,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="TOML file with a [stack] table.", dir_okay=False)
    ] = None,
) -> None:
    """Start Temporal, the engine and a worker; wait until all are healthy."""
    from durable_rollouts.stack import interrupt

    interrupt.patient()  # Ctrl-C stops what it started (up to 15 s a component): no watchdog cuts that short
    cfg = load_stack_config(config)
    from durable_rollouts.config.paths import rollouts_home
    from durable_rollouts.stack import stack

    try:
        stack.up(cfg, rollouts_home(), detach, on_ready=lambda info: _print_info(info, detach))
    except stack.StackError as err:
        raise _fail(str(err)) from None
    except KeyboardInterrupt:
        typer.echo("interrupted; stopped what had been started", err=True)
        raise typer.Exit(130) from None
    if not detach:
        typer.echo("stack stopped")


@stack_app.command()
def down() -> None:
    """Stop the stack started from $ROLLOUTS_HOME (worker, engine, then Temporal)."""
    from durable_rollouts.config.paths import rollouts_home
    from durable_rollouts.stack import stack

    try:
        stopped = stack.down(rollouts_home())
    except stack.StackError as err:
        raise _fail(str(err)) from None
    typer.echo(f"stopped: {', '.join(stopped)}" if stopped else "no stack was running")


@stack_app.command()
def status() -> None:
    """Show each component's pid, health and address; exit 1 unless every component is healthy."""
    from durable_rollouts.config.paths import rollouts_home
    from durable_rollouts.stack import stack

    rows = stack.status(rollouts_home())
    _print_status(rows)
    if not all(row.healthy for row in rows):
        raise typer.Exit(1)


@stack_app.command("search-attributes")
@temporal_options
def search_attributes(conn: Connection | None = None) -> None:
    """Register the project's search attributes on a Temporal server that lacks them (idempotent): the
    one set-up step a production server needs before the first run (docker-compose runs it)."""
    from durable_rollouts.contracts.client import describe
    from durable_rollouts.errors import ConfigError
    from durable_rollouts.stack.stack import StackError, ensure_search_attributes

    try:
        where = describe(conn)
        ensure_search_attributes(conn)
    except (StackError, ConfigError) as e:
        raise _fail(str(e)) from None
    typer.echo(f"search attributes registered on {where}")


if __name__ == "__main__":
    from durable_rollouts.stack.procs import run_main

    run_main(stack_app)
