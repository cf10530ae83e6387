"""Fault injection as a product: a TCP fault proxy, process and container faults, seeded schedules, the
chaos injector (``rollouts chaos``), and the ledger check any suite can call after a run
(``faults.ledger.check_run``) to see that no rollout was lost, duplicated or mislabelled.

Invariant: nothing here is imported by the pipeline itself; faults are injected from outside, as a user's
suite would. The names below load on first use (``from faults import FaultProxy``), so the ``rollouts``
command can mount ``chaos`` without importing the kit.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from faults.ledger import LedgerReport, Violation, check_run, check_store
    from faults.proxy import Fault, FaultProxy
    from faults.schedule import Planned, schedule

_WHERE = {
    "Fault": "faults.proxy",
    "FaultProxy": "faults.proxy",
    "LedgerReport": "faults.ledger",
    "Planned": "faults.schedule",
    "Violation": "faults.ledger",
    "check_run": "faults.ledger",
    "check_store": "faults.ledger",
    "schedule": "faults.schedule",
}

__all__ = [
    "Fault",
    "FaultProxy",
    "LedgerReport",
    "Planned",
    "Violation",
    "check_run",
    "check_store",
    "schedule",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'faults' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
