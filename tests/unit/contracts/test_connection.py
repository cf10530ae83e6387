"""How a command reaches Temporal (contracts/client.py): its own settings over the ``TEMPORAL_*`` environment
over the ``temporal`` CLI's profile over the embedded stack's defaults, with TLS as the CLI turns it on."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.service import TLSConfig

from durable_rollouts.config.models import TemporalConfig
from durable_rollouts.config.temporal import Connection
from durable_rollouts.contracts.client import describe, resolve
from durable_rollouts.errors import ConfigError

VARIABLES = (
    "TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TEMPORAL_API_KEY", "TEMPORAL_PROFILE", "TEMPORAL_CONFIG_FILE",
    "TEMPORAL_TLS", "TEMPORAL_TLS_CLIENT_CERT_PATH", "TEMPORAL_TLS_CLIENT_KEY_PATH",
    "TEMPORAL_TLS_SERVER_CA_CERT_PATH", "TEMPORAL_TLS_SERVER_NAME",
)  # fmt: skip


@pytest.fixture(autouse=True)
def no_temporal_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(tmp_path / "absent.toml"))  # never the user's own file


def test_nothing_set_reaches_the_embedded_stack() -> None:
    assert resolve() == {"target_host": "127.0.0.1:7233", "namespace": "default"}


def test_the_environment_beats_the_defaults_and_a_stated_setting_beats_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEMPORAL_ADDRESS", "temporal.example:7233")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "research")
    assert resolve() == {"target_host": "temporal.example:7233", "namespace": "research"}
    stated = resolve(Connection(address="127.0.0.1:9999"))
    assert stated == {"target_host": "127.0.0.1:9999", "namespace": "research"}


def test_a_profile_of_the_cli_s_file_is_read_and_the_environment_overrides_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n")
    config = tmp_path / "temporal.toml"
    config.write_text(
        '[profile.default]\naddress = "a.example:7233"\n\n'
        f'[profile.cloud]\naddress = "c.example:7233"\nnamespace = "team"\n\n'
        f'[profile.cloud.tls]\nserver_ca_cert_path = "{ca}"\nserver_name = "c.example"\n'
    )
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(config))
    assert resolve()["target_host"] == "a.example:7233"
    cloud = resolve(Connection(profile="cloud"))
    assert cloud["target_host"] == "c.example:7233" and cloud["namespace"] == "team"
    assert isinstance(cloud["tls"], TLSConfig) and cloud["tls"].domain == "c.example"
    assert cloud["tls"].server_root_ca_cert == ca.read_bytes()
    monkeypatch.setenv("TEMPORAL_PROFILE", "cloud")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "other")
    assert resolve()["namespace"] == "other"  # the environment over the profile
    with pytest.raises(ConfigError, match="profile 'nope'"):
        resolve(Connection(profile="nope"))


def test_an_api_key_turns_tls_on_unless_tls_is_off_and_is_never_described(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEMPORAL_API_KEY", "secret-key")
    args = resolve()
    assert args["api_key"] == "secret-key" and args["tls"] is not False
    assert resolve(Connection(tls=False))["tls"] is False
    assert "secret-key" not in describe() and "API key" in describe()
    assert "secret-key" not in repr(Connection(api_key="secret-key"))


def test_client_certificates_are_files_that_must_exist(tmp_path: Path) -> None:
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    cert.write_bytes(b"CERT")
    key.write_bytes(b"KEY")
    tls = resolve(Connection(tls_cert_path=str(cert), tls_key_path=str(key)))["tls"]
    assert isinstance(tls, TLSConfig) and (tls.client_cert, tls.client_private_key) == (b"CERT", b"KEY")
    with pytest.raises(ConfigError, match=r"missing\.pem"):
        resolve(Connection(tls_cert_path=str(tmp_path / "missing.pem")))


def test_a_run_config_s_temporal_section_states_what_it_sets_and_flags_go_on_top() -> None:
    section = TemporalConfig(address="10.1.2.3:7233", task_queue="q", profile="p")
    assert section.connection() == Connection(address="10.1.2.3:7233", profile="p")
    assert section.connection(namespace="ns", address=None) == Connection(
        address="10.1.2.3:7233", namespace="ns", profile="p"
    )
    assert TemporalConfig().connection() == Connection()  # nothing stated: environment, profile, defaults
