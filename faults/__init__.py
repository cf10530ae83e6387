"""Fault injection as a product: a TCP fault proxy, seeded schedules, and the ledger check any suite can
call after a run (``faults.ledger.check_run``) to see that no rollout was lost, duplicated or mislabelled.

Invariant: nothing here is imported by the pipeline itself; faults are injected from outside, as a user's
suite would.
"""

from faults.ledger import LedgerReport, Violation, check_run, check_store
from faults.proxy import Fault, FaultProxy
from faults.schedule import Planned, schedule

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
