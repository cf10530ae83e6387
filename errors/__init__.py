"""One error model: a base error with one subclass per boundary (engine, sandbox, environment, task, store,
config).

Invariants:
- An error is attributed once, where it crosses a boundary (engine HTTP, the sandbox, the environment, a
  task or config file, the store), as an instance of the subclass for that boundary.
- At the activity edge it becomes ``ApplicationError(type=<class name>, non_retryable=not retryable)``
  (`RolloutError.to_application_error`); workflows classify what comes back with `error_type` /
  `is_error` against these classes, never against string literals, so a renamed class is a type error.
- ``kind`` says whose fault a final failure is: ``infra`` (engine, sandbox, store, worker) or
  ``environment`` (the verifier, the task's own setup, any exception the environment's code raises).
  Infra failures are never recorded as a reward.
- An exception an environment's hook raises that is not one of these classes (a ``ZeroDivisionError`` in
  ``parse``, the base class's ``NotImplementedError``) is the environment's: it crosses the boundary as
  `EnvironmentCodeError` (``environments.base.calling``) and is recorded ``environment: <its type>:
  <message>``
  (`failure_reason`), its traceback's last frames in the record (`failure_details`). Final unless the
  environment declared it transient. The project's own errors raised inside a hook (a sandbox call's
  `SandboxError`, a `TaskFileError`) keep their class and their kind.

This module imports nothing heavier than ``temporalio.exceptions``: workflows, sandboxes, environments and
config all import it.
"""

from __future__ import annotations

import traceback
from typing import Any

from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError


class RolloutError(Exception):
    """Base of every error the project raises on purpose."""

    retryable = False
    """Whether the activity that raised it should be retried by its retry policy."""
    kind = "infra"
    """``infra`` or ``environment``: whose fault a final failure is."""
    names_cause = False
    """``str(self)`` starts with the type name of the exception it carries, which a failure's reason
    quotes instead of this class's name (`failure_reason`)."""

    def details(self) -> tuple[Any, ...]:
        """Extra values the workflow reads from the failure (``ApplicationError.details``)."""
        return ()

    def to_application_error(self) -> ApplicationError:
        return ApplicationError(
            str(self)[:1000], *self.details(), type=type(self).__name__, non_retryable=not self.retryable
        )


# -- engine -------------------------------------------------------------------------------------------
class EngineError(RolloutError):
    """The engine could not serve a model call."""


class EngineUnavailable(EngineError):
    """Transport error, timeout or 5xx: worth retrying, possibly on another replica."""

    retryable = True


class EngineStalled(EngineUnavailable):
    """The engine made no progress for the stall timeout while a call was outstanding (it accepts
    connections and never answers, or answers /health while generation stalls: ``engines.watchdog``).
    Not retried in place: the rollout fails over at once, or waits the outage out like a dead engine."""

    retryable = False


class EngineBadReply(EngineError):
    """The engine answered 2xx with a body that does not parse as the expected reply."""

    retryable = True


class EngineBadRequest(EngineError):
    """The engine rejected the request (4xx other than context length): retrying cannot help."""


class ContextLengthExceeded(EngineError):
    """The prompt no longer fits the engine's context: a truncation, not a failure."""


# -- sandbox ------------------------------------------------------------------------------------------
class SandboxError(RolloutError):
    """Base class of every sandbox failure (the sandbox itself, never the program's output)."""

    retryable = True


class SandboxGone(SandboxError):
    """The container is dead, removed, OOM-killed as a whole, or frozen: the sandbox is lost.

    Never report this as command output: the rollout's sandbox must be recreated (or the rollout failed as an
    infrastructure error), not scored.
    """

    retryable = False


class SandboxPathError(SandboxError):
    """A file path was rejected: absolute, with `..`, with NUL, or leaving the workdir through a symlink."""

    retryable = False


class SandboxNotReady(SandboxError):
    """The sandbox cannot be used yet: daemon unreachable, image missing, or container failed to start."""


class SandboxFileError(SandboxError):
    """A file operation failed because of the sandbox's contents (missing, not a regular file, too large).

    This is an outcome of the model's actions, not an infrastructure failure.
    """

    retryable = False


class SandboxSlotPending(SandboxError):
    """No sandbox slot is free yet; one is starting (or the pool is at its limit). Retry after a while."""

    retryable = False  # the workflow waits on a durable timer instead

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def details(self) -> tuple[Any, ...]:
        return (self.retry_after_s,)


# -- environment, tasks, store, config ----------------------------------------------------------------
class EnvironmentFailure(RolloutError):
    """The environment (verifier, harness, the task's setup) failed on this rollout."""

    kind = "environment"


FRAMES_KEPT = 5
"""Traceback frames of an environment's exception kept with its failure (the innermost ones)."""


class EnvironmentCodeError(EnvironmentFailure):
    """An exception raised by an environment's own code (a hook of ``environments.base.Environment``): its
    type
    name, message, the hook and the traceback's last frames, which the record keeps.

    Final, unless the environment declared the exception transient (``Environment.retryable_errors``, or
    an exception class of its own with ``retryable = True``): then the activity retries it like infra
    trouble, and it is still recorded as the environment's if the retries run out.
    """

    names_cause = True

    def __init__(self, type_name: str, message: str, hook: str, frames: list[str], retryable: bool = False):
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name, self.hook, self.frames, self.retryable = type_name, hook, frames, retryable

    def details(self) -> tuple[Any, ...]:
        return ({"type": self.type_name, "hook": self.hook, "frames": self.frames},)

    @classmethod
    def from_exception(cls, exc: BaseException, hook: str, retryable: bool = False) -> EnvironmentCodeError:
        """``exc`` as raised by the environment's ``hook``, with its traceback's last `FRAMES_KEPT` frames."""
        frames = [
            f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
            for f in traceback.extract_tb(exc.__traceback__)[-FRAMES_KEPT:]
        ]
        return cls(type(exc).__name__, str(exc), hook, frames, retryable)


class TaskFileError(RolloutError):
    """A task file is missing or malformed; the message names the file and line."""


class StoreError(RolloutError):
    """The run store misses something it must hold (a turn never stored, no sandbox recorded)."""

    retryable = True


class ConfigError(RolloutError):
    """A config file or override is invalid; str(e) is one line naming the file and field."""


def _subclasses(cls: type[RolloutError]) -> list[type[RolloutError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_subclasses(sub))
    return out


def error_class(type_name: str) -> type[RolloutError] | None:
    """The class an ``ApplicationError.type`` names, or None for a type outside this model."""
    for cls in _subclasses(RolloutError):
        if cls.__name__ == type_name:
            return cls
    return None


def application_error(e: BaseException) -> ApplicationError | None:
    """The ApplicationError inside an activity's or child workflow's failure (or ``e`` itself)."""
    while isinstance(e, ActivityError | ChildWorkflowError) and e.cause is not None:
        e = e.cause
    return e if isinstance(e, ApplicationError) else None


def error_type(e: BaseException) -> str:
    """The failure's type name: the ApplicationError's type, else the exception class's name."""
    app = application_error(e)
    if app is not None and app.type:
        return app.type
    cause = e.cause if isinstance(e, ActivityError | ChildWorkflowError) and e.cause is not None else e
    return type(cause).__name__


def is_error(e: BaseException, *classes: type[RolloutError]) -> bool:
    """Whether a failure that crossed Temporal is one of ``classes`` (or a subclass of one)."""
    cls = error_class(error_type(e))
    return cls is not None and issubclass(cls, classes)


def names(*classes: type[RolloutError]) -> list[str]:
    """Type names of ``classes`` and all their subclasses (for ``RetryPolicy.non_retryable_error_types``)."""
    return sorted({c.__name__ for cls in classes for c in _subclasses(cls)})


def failure_kind(e: BaseException) -> str:
    """``environment`` for environment errors, else ``infra`` (unknown types are infrastructure)."""
    cls = error_class(error_type(e))
    return cls.kind if cls is not None else "infra"


def failure_reason(e: BaseException) -> str:
    """The reason a rollout that finally failed with ``e`` is recorded with: ``<kind>: <Type>: <message>``
    (at most 500 characters). The Type is the failure's class, or for an exception of an environment's
    own code its own type (``environment: ZeroDivisionError: division by zero``)."""
    cause = e.cause if isinstance(e, ActivityError | ChildWorkflowError) and e.cause is not None else e
    message = cause.message if isinstance(cause, ApplicationError) else str(cause)
    cls = error_class(error_type(e))
    label = message if cls is not None and cls.names_cause else f"{error_type(e)}: {message}"
    return f"{failure_kind(e)}: {label}"[:500]


def failure_details(e: BaseException) -> dict[str, Any] | None:
    """What a failure carries for its record beyond the reason (an environment exception's type, hook and
    last frames), or None."""
    cls = error_class(error_type(e))
    app = application_error(e)
    if cls is None or not cls.names_cause or app is None or not app.details:
        return None
    details = app.details[0]
    return details if isinstance(details, dict) else None
