"""Fixtures of the TRL integration's tests: the repository's own (real Temporal dev server, vLLM-CPU engine).

No ``__init__.py`` here: these modules are imported by their own names, never colliding with ``tests``.
"""

from tests.conftest import client, pytest_runtest_makereport, task_queue, temporal_env  # noqa: F401
