"""The one place a Temporal client is built: pydantic models cross the wire through the pydantic data
converter, which is part of the contract (every client, worker and replayer uses it), and every command and
worker reaches Temporal the way the ``temporal`` CLI does.

Where a connection setting comes from, first found wins (`resolve`):

1. what the command says: a flag (``--address``, ``--namespace``, ``--api-key``, ``--tls-cert-path``,
   ``--tls-key-path``, ``--tls-ca-path``, ``--tls-server-name``, ``--profile``, the ``temporal`` CLI's
   names), or a run config's ``[temporal]`` section;
2. the environment, as the ``temporal`` CLI reads it: ``TEMPORAL_ADDRESS``, ``TEMPORAL_NAMESPACE``,
   ``TEMPORAL_API_KEY``, ``TEMPORAL_TLS_CLIENT_CERT_PATH``, ``TEMPORAL_TLS_CLIENT_KEY_PATH``,
   ``TEMPORAL_TLS_SERVER_CA_CERT_PATH``, ``TEMPORAL_TLS_SERVER_NAME``, ``TEMPORAL_TLS``, ...;
3. the profile (``TEMPORAL_PROFILE`` or ``--profile``, else ``default``) of the CLI's configuration file
   (``TEMPORAL_CONFIG_FILE``, else the CLI's default location), loaded by the SDK's own
   ``temporalio.envconfig``;
4. the embedded stack's defaults: ``127.0.0.1:7233``, namespace ``default``, no TLS.

An API key or a client certificate turns TLS on unless TLS is disabled explicitly, as in the CLI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_ADDRESS", "DEFAULT_NAMESPACE", "Connection", "cli_args", "connect", "describe", "resolve"]

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfigProfile, ClientConfigTLS
from temporalio.runtime import Runtime

from durable_rollouts.config.temporal import Connection
from durable_rollouts.errors import ConfigError

DEFAULT_ADDRESS = "127.0.0.1:7233"
"""The embedded stack's Temporal frontend (``rollouts stack up``)."""
DEFAULT_NAMESPACE = "default"


def _profile(conn: Connection) -> ClientConfigProfile:
    try:
        return ClientConfigProfile.load(
            profile=conn.profile, config_source=Path(conn.config_file) if conn.config_file else None
        )
    except Exception as e:  # the SDK raises its own types for a missing profile or a bad file
        where = conn.config_file or "the Temporal CLI's configuration file"
        raise ConfigError(
            f"temporal: cannot load profile {conn.profile or 'default'!r} from {where}: {e}"
        ) from e


def _tls(conn: Connection, loaded: ClientConfigTLS | None) -> ClientConfigTLS | None:
    """The profile's TLS settings with the connection's own on top."""
    files = {
        "client_cert": conn.tls_cert_path,
        "client_private_key": conn.tls_key_path,
        "server_root_ca_cert": conn.tls_ca_path,
    }
    stated = {k: Path(v) for k, v in files.items() if v}
    for key, path in stated.items():
        if not path.is_file():
            raise ConfigError(f"temporal: {key.replace('_', ' ')} file {str(path)!r} does not exist")
    if not stated and conn.tls is None and conn.tls_server_name is None:
        return loaded
    base = loaded or ClientConfigTLS()
    return ClientConfigTLS(
        disabled=(not conn.tls) if conn.tls is not None else base.disabled,
        server_name=conn.tls_server_name or base.server_name,
        server_root_ca_cert=stated.get("server_root_ca_cert", base.server_root_ca_cert),
        client_cert=stated.get("client_cert", base.client_cert),
        client_private_key=stated.get("client_private_key", base.client_private_key),
    )


def resolve(conn: Connection | None = None) -> dict[str, Any]:
    """Keyword arguments for ``Client.connect`` (``target_host``, ``namespace``, ``api_key``, ``tls``): the
    connection's settings over the environment's over the profile's over the defaults.

    Raises:
        ConfigError: a profile that cannot be loaded, or a certificate file that does not exist (one line).
    """
    conn = conn or Connection()
    prof = _profile(conn)
    merged = ClientConfigProfile(
        address=conn.address or prof.address or DEFAULT_ADDRESS,
        namespace=conn.namespace or prof.namespace or DEFAULT_NAMESPACE,
        api_key=conn.api_key or prof.api_key,
        tls=_tls(conn, prof.tls),
        grpc_meta=prof.grpc_meta,
    )
    return dict(merged.to_client_connect_config())  # an API key alone turns TLS on (the SDK's rule)


def describe(conn: Connection | None = None) -> str:
    """``host:port (namespace N[, TLS][, API key])`` for messages: never the key itself."""
    args = resolve(conn)
    extras = [f"namespace {args['namespace']}"]
    if args.get("tls"):
        extras.append("TLS")
    if args.get("api_key"):
        extras.append("API key")
    return f"{args['target_host']} ({', '.join(extras)})"


CLI_FLAGS = {
    "api_key": "--api-key",
    "tls_cert_path": "--tls-cert-path",
    "tls_key_path": "--tls-key-path",
    "tls_ca_path": "--tls-ca-path",
    "tls_server_name": "--tls-server-name",
}
"""Connection settings as the ``temporal`` CLI's flags (address and namespace are passed resolved)."""


def cli_args(conn: Connection | None = None) -> list[str]:
    """The flags that point the ``temporal`` CLI where `connect` goes: the resolved address and namespace,
    and the TLS and API-key settings stated here (the CLI reads the environment's and the profile's
    itself)."""
    conn = conn or Connection()
    args = resolve(conn)
    argv = ["--address", args["target_host"], "--namespace", args["namespace"]]
    for field, flag in CLI_FLAGS.items():
        value = getattr(conn, field)
        if value is not None:
            argv += [flag, value]
    if conn.tls is not None:
        argv.append("--tls" if conn.tls else "--tls=false")
    return argv


async def connect(
    address: str | Connection | None = None, namespace: str | None = None, runtime: Runtime | None = None
) -> Client:
    """Connect to Temporal with the project's data converter. ``address`` is a host:port or a whole
    `Connection` (None: from the environment, the profile or the defaults); ``namespace`` overrides the
    connection's; ``runtime`` (e.g. one that serves the SDK's metrics, see
    ``metrics.serve.temporal_runtime``) defaults to the SDK's."""
    conn = address if isinstance(address, Connection) else Connection(address=address)
    if namespace is not None:
        conn = conn.model_copy(update={"namespace": namespace})
    args = resolve(conn)
    return await Client.connect(**args, data_converter=pydantic_data_converter, runtime=runtime)
