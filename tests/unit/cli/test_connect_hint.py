"""What a command says to check when Temporal cannot be reached: the certificates for a TLS connection or a
TLS error, the embedded stack for its own address, the address otherwise (cli.common.connect_hint)."""

from __future__ import annotations

import pytest

from durable_rollouts.cli.common import connect_hint


@pytest.mark.parametrize(
    "where,error,says",
    [
        ("10.0.0.5:7233 (namespace default, TLS)", "Connection refused", "--tls-cert-path"),
        ("10.0.0.5:7233 (namespace default)", "tls handshake eof", "--tls-cert-path"),
        ("10.0.0.5:7233 (namespace default)", "invalid peer certificate: UnknownIssuer", "TEMPORAL_TLS_*"),
        ("127.0.0.1:7233 (namespace default)", "Connection refused", "rollouts stack up -d"),
        ("temporal.internal:7233 (namespace rl)", "Connection refused", "TEMPORAL_ADDRESS"),
    ],
)
def test_the_hint_names_what_to_check(where: str, error: str, says: str) -> None:
    hint = connect_hint(where, error)
    assert says in hint and "\n" not in hint
    if says != "rollouts stack up -d":
        assert "stack up" not in hint  # never the embedded stack for a server elsewhere or a TLS refusal
