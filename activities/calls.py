"""How each activity is called: its timeouts and retry policy, declared once, at its definition.

Invariant: every caller of an activity gets the options declared beside it (``@options(...)``); a
caller may only substitute what depends on the run's config (the engine retry policy, a timeout derived
from ``engine.request_timeout_s``) and does so through the same declaration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityCancellationType

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Options:
    """Timeouts, retry policy and kind (local or regular) of one activity."""

    start_to_close: timedelta
    retry: RetryPolicy | None = None
    heartbeat: timedelta | None = None
    local: bool = False
    """Run as a local activity (a marker event in history instead of three; retried by the worker)."""
    wait_cancellation: bool = False
    """A cancelled call is awaited until the activity has stopped (it learns of the cancel by its next
    heartbeat), so nothing it writes can land after the caller moved on (e.g. after the record)."""
    local_retry_threshold: timedelta | None = None
    """Local activities: a retry whose backoff is longer than this waits on a durable timer, which ends
    the caller's workflow task (and frees its worker slot), instead of inside that task (the SDK's
    default: one minute)."""

    def kwargs(
        self, retry: RetryPolicy | None = None, start_to_close: timedelta | None = None
    ) -> dict[str, Any]:
        """Keyword arguments of ``workflow.execute_(local_)activity_method``."""
        kw: dict[str, Any] = {"start_to_close_timeout": start_to_close or self.start_to_close}
        if retry or self.retry:
            kw["retry_policy"] = retry or self.retry
        if self.heartbeat is not None and not self.local:
            kw["heartbeat_timeout"] = self.heartbeat
        if self.wait_cancellation:
            kw["cancellation_type"] = ActivityCancellationType.WAIT_CANCELLATION_COMPLETED
        if self.local and self.local_retry_threshold is not None:
            kw["local_retry_threshold"] = self.local_retry_threshold
        return kw


def options(opts: Options) -> Callable[[F], F]:
    """Declare an activity's options (read back by `options_of`)."""

    def deco(fn: F) -> F:
        fn.__dict__["_activity_options"] = opts
        return fn

    return deco


def options_of(fn: Callable[..., Any]) -> Options:
    """The options declared for an activity function or method."""
    opts = getattr(fn, "_activity_options", None)
    if not isinstance(opts, Options):
        raise TypeError(f"{getattr(fn, '__qualname__', fn)} declares no activity options")
    return opts
