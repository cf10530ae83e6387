"""Sandboxes where model-generated code runs: interface, data types, errors and the Docker backend.

Invariant: model-generated code runs only inside a hardened sandbox, and a lost sandbox is raised as
`SandboxGone`, never reported as the program's output.
"""

from durable_rollouts.errors import (
    SandboxError,
    SandboxFileError,
    SandboxGone,
    SandboxNotReady,
    SandboxPathError,
)
from durable_rollouts.sandboxes.base import (
    DEFAULT_IMAGE,
    AsyncSandboxBackend,
    ExecResult,
    SandboxBackend,
    SandboxHandle,
    SandboxInfo,
    SandboxSpec,
    validate_relative_path,
)
from durable_rollouts.sandboxes.docker_backend import DockerBackend, container_name

__all__ = [
    "DEFAULT_IMAGE",
    "AsyncSandboxBackend",
    "DockerBackend",
    "ExecResult",
    "SandboxBackend",
    "SandboxError",
    "SandboxFileError",
    "SandboxGone",
    "SandboxHandle",
    "SandboxInfo",
    "SandboxNotReady",
    "SandboxPathError",
    "SandboxSpec",
    "container_name",
    "validate_relative_path",
]
