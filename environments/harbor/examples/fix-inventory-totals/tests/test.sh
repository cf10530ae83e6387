#!/bin/bash
# Hidden tests against the repository in /app (run from /app so the package imports).
cd /app
python3 -m pytest -q -p no:cacheprovider /tests/test_hidden.py
rc=$?

if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
