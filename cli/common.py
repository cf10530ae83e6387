"""What every ``rollouts`` command shares: the one-line error exit, the run store and the Temporal client.

Heavy imports happen inside the functions, so ``--help`` answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from temporalio.client import Client

    from durable_rollouts.store import RunStore


def fail(msg: str, code: int = 2) -> typer.Exit:
    """``error: msg`` on stderr; the exit (code 2: bad input; 1: a service unreachable) to raise."""
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


def run_store(url: str | None = None) -> RunStore:
    """The run store ``url`` names, else the configured one ($ROLLOUTS_STORE, else $ROLLOUTS_HOME; imported
    lazily, so the CLI starts fast); a bad URL or a server that does not answer is one line and exit 2."""
    from durable_rollouts.errors import ConfigError
    from durable_rollouts.store import open_store

    try:
        return open_store(url)
    except ConfigError as e:
        raise fail(str(e)) from None


async def temporal_client(address: str, namespace: str = "default") -> Client:
    """A client of the Temporal frontend at ``address``; one that does not answer is one line and exit 1."""
    from durable_rollouts.contracts.client import connect

    try:
        return await connect(address, namespace)
    except Exception as e:  # the SDK raises RuntimeError for connection problems
        hint = "is the stack up? try `rollouts stack up -d`"
        raise fail(f"cannot reach Temporal at {address} ({e}); {hint}", 1) from None
