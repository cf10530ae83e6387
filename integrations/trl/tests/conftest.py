"""Fixtures of the TRL integration's tests: the repository's own (real Temporal dev server, vLLM-CPU engine).

No ``__init__.py`` here: these modules are imported by their own names, never colliding with ``tests``.
The repository root goes on ``sys.path`` (last) when this folder runs alone, for its ``tests`` package.
"""

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[3])
if _REPO not in sys.path:
    sys.path.append(_REPO)

from tests.conftest import client, pytest_runtest_makereport, task_queue, temporal_env  # noqa: E402, F401
