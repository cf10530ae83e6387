"""`rollouts feed status|take|batch`: the trainer feed of a run, from the command line.

Invariant: a view of :class:`trainer.feed.TrainerFeed` and nothing more; every decision (freshness,
discards, marks) is made there. Mistakes print one `error: ...` line and exit 2; heavy imports wait
until a command runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from durable_rollouts.trainer.feed import TrainerFeed

feed_app = typer.Typer(
    help="Take fresh, complete groups of a run for training; show the books.", no_args_is_help=True
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _feed(run_id: str) -> TrainerFeed:
    from durable_rollouts.errors import ConfigError
    from durable_rollouts.store import open_store
    from durable_rollouts.trainer.feed import TrainerFeed

    try:
        store = open_store()
    except ConfigError as e:
        raise _fail(str(e)) from None
    if store.get_run(run_id) is None:
        raise _fail(f"no run {run_id!r} in the store at {store.location}")
    return TrainerFeed(store, run_id)


def _write(lines: list[dict], output: Path) -> None:
    with output.open("w", encoding="utf-8") as fh:
        for obj in lines:
            fh.write(json.dumps(obj, separators=(",", ":")) + "\n")


@feed_app.command()
def status(run_id: str) -> None:
    """The run's books (generated = consumed + discarded + waiting) and the mix of discarded records."""
    from rich.console import Console
    from rich.table import Table

    feed = _feed(run_id)
    led = feed.ledger()
    table = Table(title=f"feed of {run_id}")
    for col in ("", "records", "sampled tokens"):
        table.add_column(col, justify="right" if col else "left")
    for name in ("generated", "consumed", "discarded", "waiting"):
        c = getattr(led, name)
        table.add_row(name, str(c.records), str(c.tokens))
    console = Console()
    console.print(table)
    console.print("books balance" if led.balanced else "[red]books do NOT balance[/red]")
    report = feed.discard_report()
    if report["by_reason"]:
        mix = Table(title="discarded records (of generated)")
        for col in ("by", "key", "discarded", "generated"):
            mix.add_column(col)
        for reason, n in report["by_reason"].items():
            mix.add_row("reason", reason, str(n), "")
        for by in ("by_task", "by_length"):
            for key, pair in report[by].items():
                mix.add_row(by[3:], key, str(pair["discarded"]), str(pair["generated"]))
        console.print(mix)
        means = ", ".join(f"{k} {v:.1f}" for k, v in report["mean_length"].items() if v is not None)
        console.print(f"mean sampled tokens per record: {means}")
    if not led.balanced:
        raise typer.Exit(1)


@feed_app.command()
def take(
    run_id: str,
    n: Annotated[int, typer.Option("--n", min=0, help="Groups to consume at most.")],
    version: Annotated[str, typer.Option("--version", help="The trainer's current policy version.")],
    max_lag: Annotated[int, typer.Option("--max-lag", min=0, help="Publishes a sample may lag behind.")],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="JSONL file for the batch.")] = None,
    drop_zero_variance: Annotated[bool, typer.Option(help="Discard zero-variance groups.")] = False,
    logprob_mode: Annotated[
        str | None, typer.Option(help="Discard groups whose records declare another logprobs mode.")
    ] = None,
) -> None:
    """Consume up to N complete groups fresh for VERSION (stale ones are discarded with a reason)."""
    from durable_rollouts.trainer.feed import FeedError

    feed = _feed(run_id)
    try:
        batch = feed.take(
            n, version, max_lag, drop_zero_variance=drop_zero_variance, logprob_mode=logprob_mode
        )
    except FeedError as e:
        raise _fail(str(e)) from None
    if output is not None:
        _write(batch.lines(), output)
    c = batch.count
    where = f" to {output}" if output is not None else ""
    typer.echo(
        f"batch {batch.batch_id or '-'}: consumed {len(batch.groups)} groups ({c.records} records, "
        f"{c.tokens} sampled tokens){where}; discarded {len(batch.discarded)} groups"
    )
    for d in batch.discarded:
        typer.echo(f"  discarded {d.group_id}: {d.reason}")


@feed_app.command()
def batch(
    run_id: str,
    batch_id: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="JSONL file to write.")],
) -> None:
    """Write an already consumed batch again (for a trainer that restarted)."""
    from durable_rollouts.trainer.feed import FeedError

    try:
        lines = _feed(run_id).batch(batch_id)
    except FeedError as e:
        raise _fail(str(e)) from None
    _write(lines, output)
    typer.echo(f"wrote {len(lines)} lines of batch {batch_id} to {output}")
