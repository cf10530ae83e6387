#!/usr/bin/env python3
"""SymPy's test runner script (bin/test in SymPy's repository, which its sdist does not ship), reduced to the
options SWE-bench's sympy test command uses: ``bin/test -C --verbose PATH...``.

-C/--no-cache runs without SymPy's cache (set before sympy is imported, as the original does); --verbose
prints one ``test_name ok`` / ``F`` / ``E`` line per test, the format SWE-bench's sympy log parser reads.
"""

import argparse
import os
import sys

parser = argparse.ArgumentParser(description="Run SymPy's tests (sympy.testing.runtests).")
parser.add_argument("paths", nargs="*", help="test files or folders")
parser.add_argument("-C", "--no-cache", dest="cache", action="store_false", default=True)
parser.add_argument("-v", "--verbose", action="store_true", default=False)
parser.add_argument("-k", dest="kw", action="append", default=None, help="only tests matching this")
options = parser.parse_args()

if not options.cache:
    os.environ["SYMPY_USE_CACHE"] = "no"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sympy.testing.runtests import test  # noqa: E402  (after the cache setting, as the original)

# SymPy's own runner (sympy.test() hands over to pytest when pytest is installed; bin/test never did), in
# this process: no second interpreter start for hash randomisation.
ok = test(*options.paths, verbose=options.verbose, kw=options.kw, subprocess=False)
sys.exit(0 if ok else 1)
