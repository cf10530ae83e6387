"""One error model: a base rollout error with one subclass per boundary.

Invariant: an error is attributed once, where it crosses a boundary (engine HTTP, environment, task file),
and converted to ``ApplicationError(type=<class name>, non_retryable=...)`` at the activity edge, so the
workflow can tell infrastructure failures from environment failures without parsing messages.
"""

from __future__ import annotations

from temporalio.exceptions import ApplicationError


class RolloutError(Exception):
    """Base of every error the project raises on purpose."""

    retryable = False
    kind = "infra"

    def to_application_error(self) -> ApplicationError:
        return ApplicationError(str(self), type=type(self).__name__, non_retryable=not self.retryable)


class EngineError(RolloutError):
    """The engine could not serve a model call."""


class EngineUnavailable(EngineError):
    """Transport error, timeout or 5xx: worth retrying, possibly on another replica."""

    retryable = True


class EngineBadReply(EngineError):
    """The engine answered 2xx with a body that does not parse as the expected reply."""

    retryable = True


class EngineBadRequest(EngineError):
    """The engine rejected the request (4xx other than context length): retrying cannot help."""


class ContextLengthExceeded(EngineError):
    """The prompt no longer fits the engine's context: a truncation, not a failure."""


class EnvironmentFailure(RolloutError):
    """The environment (verifier, harness) failed on this rollout."""

    kind = "environment"


class TaskFileError(RolloutError):
    """A task file is missing or malformed; the message names the file and line."""


# Types the workflow treats as infrastructure vs environment when an activity finally fails.
INFRA_TYPES = frozenset(
    {"EngineUnavailable", "EngineBadReply", "EngineBadRequest", "TaskFileError", "StoreError"}
)
ENVIRONMENT_TYPES = frozenset({"EnvironmentFailure"})
