"""What every ``rollouts`` command shares: the one-line error exit, the run store and the Temporal client.

Heavy imports happen inside the functions, so ``--help`` answers at once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

if TYPE_CHECKING:
    from temporalio.client import Client

    from durable_rollouts.config.temporal import Connection
    from durable_rollouts.store import RunStore

F = TypeVar("F", bound=Callable[..., Any])

CONNECTION_FLAGS: dict[str, tuple[str, str]] = {
    "address": (
        "--address",
        "Temporal frontend host:port (default: TEMPORAL_ADDRESS, the profile, else 127.0.0.1:7233).",
    ),
    "namespace": (
        "--namespace",
        "Temporal namespace (default: TEMPORAL_NAMESPACE, the profile, else default).",
    ),
    "api_key": ("--api-key", "API key; turns TLS on (default: TEMPORAL_API_KEY, better: argv is visible)."),
    "tls_cert_path": (
        "--tls-cert-path",
        "Client certificate (PEM), mutual TLS (TEMPORAL_TLS_CLIENT_CERT_PATH).",
    ),
    "tls_key_path": (
        "--tls-key-path",
        "Client private key (PEM), mutual TLS (TEMPORAL_TLS_CLIENT_KEY_PATH).",
    ),
    "tls_ca_path": (
        "--tls-ca-path",
        "CA certificate (PEM) of the server (TEMPORAL_TLS_SERVER_CA_CERT_PATH).",
    ),
    "tls_server_name": (
        "--tls-server-name",
        "Name the server's certificate must carry (TEMPORAL_TLS_SERVER_NAME).",
    ),
    "profile": ("--profile", "Profile of the temporal CLI's configuration file (TEMPORAL_PROFILE)."),
}
"""The ``temporal`` CLI's connection flags, as every command that reaches Temporal takes them
(contracts/client.py: flags, then TEMPORAL_* variables, then the profile, then the embedded stack)."""


def temporal_options(command: F) -> F:
    """Give a command the Temporal connection flags (`CONNECTION_FLAGS`); it receives them as one
    ``conn: Connection`` argument, its settings those the flags state."""
    signature = inspect.signature(command)
    # The command's own annotations, evaluated in its module (``conn``'s type is only imported for type
    # checking there, so it is left out: the wrapper makes it).
    kept = [
        p.replace(
            annotation=eval(p.annotation, command.__globals__)
            if isinstance(p.annotation, str)
            else p.annotation
        )
        for p in signature.parameters.values()
        if p.name != "conn"
    ]
    added = [
        inspect.Parameter(
            field, inspect.Parameter.KEYWORD_ONLY, default=None,
            annotation=Annotated[str | None, typer.Option(flag, help=text, rich_help_panel="Temporal")],
        )
        for field, (flag, text) in CONNECTION_FLAGS.items()
    ]  # fmt: skip

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from durable_rollouts.config.temporal import Connection

        conn = Connection(**{field: kwargs.pop(field, None) for field in CONNECTION_FLAGS})
        return command(*args, conn=conn, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=kept + added)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in kept + added}  # what typer reads, evaluated
    return wrapper  # type: ignore[return-value]


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


async def temporal_client(conn: Connection | None = None) -> Client:
    """A client of Temporal as ``conn`` and the environment say (contracts/client.py); a profile or
    certificate file that cannot be read is one line and exit 2, a server that does not answer exit 1."""
    from durable_rollouts.contracts.client import connect, describe
    from durable_rollouts.errors import ConfigError

    try:
        where = describe(conn)
    except ConfigError as e:
        raise fail(str(e)) from None
    try:
        return await connect(conn)
    except Exception as e:  # the SDK raises RuntimeError for connection problems
        raise fail(f"cannot reach Temporal at {where} ({e}); {connect_hint(where, str(e))}", 1) from None


def connect_hint(where: str, error: str) -> str:
    """What to check when Temporal at ``where`` (as `describe` puts it) refused or did not answer."""
    tls_words = ("tls", "ssl", "certificate", "handshake", "alert")
    if "TLS" in where or any(w in error.lower() for w in tls_words):
        return (
            "check the client certificate, key and CA (--tls-cert-path, --tls-key-path, --tls-ca-path, "
            "or TEMPORAL_TLS_*) and that the server expects TLS"
        )
    if where.startswith(("127.0.0.1:7233 ", "localhost:7233 ")):
        return "is the stack up? try `rollouts stack up -d`"
    return "is the server up and reachable from here? (--address, or TEMPORAL_ADDRESS)"
