#!/bin/bash
[ "$(cat /app/hello.txt 2>/dev/null)" = "Hello, world!" ]
rc=$?

if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
