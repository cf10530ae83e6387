"""How a command or a worker reaches Temporal, as it states it: the connection settings of the ``temporal``
CLI (address, namespace, API key, TLS files, profile). ``contracts.client.resolve`` fills in what is left
unstated from the environment, the CLI's profile and the embedded stack's defaults."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Connection(BaseModel):
    """How to reach Temporal, as a command or a config states it; None: from the environment, the
    profile or the defaults (module docstring). Never stored with a run (it may hold a key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str | None = None
    """host:port of the Temporal frontend."""
    namespace: str | None = None
    """The namespace holding the workflows."""
    api_key: str | None = Field(None, repr=False)
    """API key (Temporal Cloud, or a server that checks one); turns TLS on."""
    tls: bool | None = None
    """TLS on or off; None: on when a key, certificate or CA is given."""
    tls_cert_path: str | None = None
    """Client certificate (PEM) for mutual TLS."""
    tls_key_path: str | None = None
    """Client private key (PEM) for mutual TLS."""
    tls_ca_path: str | None = None
    """CA certificate (PEM) the server's certificate is checked against; None: the system's."""
    tls_server_name: str | None = None
    """Server name the certificate is checked for, when it differs from the address's host."""
    profile: str | None = None
    """Profile of the CLI's configuration file."""
    config_file: str | None = None
    """The CLI's configuration file (TOML); None: ``TEMPORAL_CONFIG_FILE``, else the CLI's default."""

    def given(self) -> dict[str, Any]:
        """The settings this connection states (the rest come from the environment and the profile)."""
        return self.model_dump(exclude_none=True)
