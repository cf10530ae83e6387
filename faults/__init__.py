"""Fault injection as a product: a TCP fault proxy, process and container faults, network faults between
the parts of a cluster of network namespaces (`NetFault`, `parse_net_fault`), a PostgreSQL restart
(``faults.pgrestart``), seeded schedules, the chaos injector (``rollouts chaos``), and the ledger check any
suite can call after a run (``faults.ledger.check_run``) to see that no rollout was lost, duplicated or
mislabelled.

Invariant: nothing here is imported by the pipeline itself; faults are injected from outside, as a user's
suite would. The ledger's names load on first use, so the ``rollouts`` command can mount ``chaos``
without importing the store.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from durable_rollouts.faults.netfaults import NetFault
from durable_rollouts.faults.netfaults import parse as parse_net_fault
from durable_rollouts.faults.proxy import Fault, FaultProxy
from durable_rollouts.faults.schedule import (  # binds the function over the submodule of that name
    Planned,
    schedule,
)

if TYPE_CHECKING:
    from durable_rollouts.faults.ledger import LedgerReport, Violation, check_run, check_store

_LAZY = {"LedgerReport", "Violation", "check_run", "check_store"}
"""The ledger's names (it imports the store and the trainer feed): loaded on first use."""

__all__ = [
    "Fault",
    "FaultProxy",
    "LedgerReport",
    "NetFault",
    "Planned",
    "Violation",
    "check_run",
    "check_store",
    "parse_net_fault",
    "schedule",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'faults' has no attribute {name!r}")
    return getattr(importlib.import_module("durable_rollouts.faults.ledger"), name)
