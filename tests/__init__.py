"""The project's tests: they run from a checkout, and read its files through ``REPO_ROOT``."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The checkout the tests run from (tests only: the package itself never reads a checkout)."""
