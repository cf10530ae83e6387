#!/bin/bash
python3 -c 'import json,sys; sys.exit(0 if json.load(open("/app/errors.json")) == {"api": 3, "db": 1, "web": 0} else 1)'
rc=$?

if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
