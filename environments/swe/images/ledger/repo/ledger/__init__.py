"""ledger: bookkeeping helpers."""

from ledger.intervals import merge
from ledger.money import split

__all__ = ["merge", "split"]
