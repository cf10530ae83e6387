"""Injected faults of the simulated engine, set at start (CLI flags) or at runtime (``POST /fault``).

Invariant: faults touch only ``POST /inference/v1/generate`` (and ``unhealthy`` only ``GET /health``), and
each counted fault fires exactly as many times as asked: ``fail_next=3`` fails the next three generate
requests and no others. A hang holds requests until it is cleared (they then complete normally) or the
server stops (they then get 503), while /health keeps answering 200.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field


class FaultUpdate(BaseModel):
    """Body of ``POST /fault``: the fields given are set, the others keep their value."""

    model_config = ConfigDict(extra="forbid")

    fail_next: int | None = Field(default=None, ge=0)
    """Answer the next N generate requests with ``fail_status`` at once."""
    fail_status: int | None = Field(default=None, ge=400, le=599)
    """HTTP status of failed requests (default 503)."""
    hang: bool | None = None
    """True: generate requests wait, unanswered, until this is set back to False."""
    drop_next: int | None = Field(default=None, ge=0)
    """Close the connection of the next N generate requests after generating, without answering."""
    unhealthy: bool | None = None
    """True: ``GET /health`` answers 503."""


class Faults:
    """The engine's current faults; tests may also set the attributes directly."""

    def __init__(self) -> None:
        self.fail_next = 0
        self.fail_status = 503
        self.drop_next = 0
        self.unhealthy = False
        self.closing = False
        self._released = asyncio.Event()
        self._released.set()

    @property
    def hang(self) -> bool:
        return not self._released.is_set()

    @hang.setter
    def hang(self, value: bool) -> None:
        if value:
            self._released.clear()
        else:
            self._released.set()

    def apply(self, update: FaultUpdate) -> None:
        for name, value in update.model_dump(exclude_none=True).items():
            setattr(self, name, value)

    def snapshot(self) -> dict[str, int | bool]:
        return {
            "fail_next": self.fail_next,
            "fail_status": self.fail_status,
            "hang": self.hang,
            "drop_next": self.drop_next,
            "unhealthy": self.unhealthy,
        }

    def take_failure(self) -> int | None:
        """The status to fail this request with, or None; counts the failure down."""
        if self.fail_next <= 0:
            return None
        self.fail_next -= 1
        return self.fail_status

    def take_drop(self) -> bool:
        """Whether to drop this request's connection; counts the drop down."""
        if self.drop_next <= 0:
            return False
        self.drop_next -= 1
        return True

    async def wait_while_hung(self) -> None:
        await self._released.wait()

    def release_for_shutdown(self) -> None:
        """Wake every hung request; they see ``closing`` and answer 503."""
        self.closing = True
        self._released.set()
