#!/bin/bash
expected=$'5 10.0.0.1\n4 10.0.0.2\n1 10.0.0.3'
if [ -f /app/top_ips.txt ] && [ "$(cat /app/top_ips.txt)" = "$expected" ]; then rc=0; else rc=1; fi
echo "got: $(cat /app/top_ips.txt 2>/dev/null)"

if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
