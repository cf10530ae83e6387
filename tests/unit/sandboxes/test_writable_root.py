"""``sandbox.writable_root``: off unless the operator turns it on."""

from __future__ import annotations

from durable_rollouts.config.load import load_config
from durable_rollouts.sandboxes.base import SandboxSpec


def test_the_root_filesystem_is_read_only_unless_the_operator_says_otherwise() -> None:
    assert SandboxSpec().writable_root is False
    assert load_config(None).sandbox.writable_root is False
    assert load_config(None, ["sandbox.writable_root=true"]).sandbox.writable_root is True
