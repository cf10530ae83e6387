#!/usr/bin/env bash
# Prepare the build context of the SWE-bench-style sympy instance image (run by build_images.sh on the
# host, with the context folder as $1): SymPy's sdist without its test folders but the one its rows run,
# plus bin/test (SymPy's test runner script, which the sdist does not ship), as a git repository with one
# commit (context/repo, its id in context/base_commit); mpmath from its sdist; git and patch as Debian
# packages (context/debs).
set -euo pipefail
ctx=$1
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../sdist_repo.sh
source "$here/../sdist_repo.sh"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
sdist sympy 1.14.0 "$src/sympy"
sdist mpmath 1.3.0 "$src/mpmath"
mkdir -p "$ctx/repo/bin" "$ctx/site-packages"
cp -a "$src/sympy/sympy" "$src/sympy/LICENSE" "$src/sympy/README.md" "$ctx/repo/"
find "$ctx/repo/sympy" -type d \( -name tests -o -name benchmarks \) -not -path '*/sympy/utilities/tests' \
    -prune -exec rm -rf {} +
find "$ctx/repo/sympy/utilities/tests" -type f -not -name __init__.py -not -name test_iterables.py -delete
cp "$here/bin_test.py" "$ctx/repo/bin/test"
chmod 755 "$ctx/repo/bin/test"
commit "$ctx/repo"
cp -a "$src/mpmath/mpmath" "$ctx/site-packages/"
debs "$ctx/debs" git patch
