#!/usr/bin/env bash
# Prepare the build context of the SWE-bench-style django instance image (run by build_images.sh on the
# host, with the context folder as $1): Django's sdist, trimmed to the package and the one test module its
# rows run, as a git repository with one commit (context/repo, its id in context/base_commit); asgiref and
# sqlparse (Django's dependencies) from their sdists; git and patch as Debian packages (context/debs).
set -euo pipefail
ctx=$1
# shellcheck source=../sdist_repo.sh
source "$(dirname "$0")/../sdist_repo.sh"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
sdist django 5.2.9 "$src/django"
sdist asgiref 3.9.2 "$src/asgiref"
sdist sqlparse 0.5.3 "$src/sqlparse"
mkdir -p "$ctx/repo/tests/utils_tests" "$ctx/site-packages"
# The package without its translations (but English's formats), GeoDjango and static assets (none of them used by these tests).
cp -a "$src/django/django" "$src/django/LICENSE" "$src/django/README.rst" "$ctx/repo/"
find "$ctx/repo/django/contrib" -type d \( -name locale -o -name static \) -prune -exec rm -rf {} +
find "$ctx/repo/django/conf/locale" -mindepth 1 -maxdepth 1 -type d -not -name en -exec rm -rf {} +
rm -rf "$ctx/repo/django/contrib/gis"
for f in runtests.py test_sqlite.py urls.py README.rst utils_tests/__init__.py utils_tests/test_text.py; do
    cp -a "$src/django/tests/$f" "$ctx/repo/tests/$f"
done
commit "$ctx/repo"
cp -a "$src/asgiref/asgiref" "$src/sqlparse/sqlparse" "$ctx/site-packages/"
debs "$ctx/debs" git patch
