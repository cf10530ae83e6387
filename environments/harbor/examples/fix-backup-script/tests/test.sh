#!/bin/bash
t=$(mktemp -d)
echo a > "$t/one.txt"; echo b > "$t/two words.txt"; echo c > "$t/skip.md"
bash /app/backup.sh "$t" >/dev/null 2>&1
[ -f "$t/backup/one.txt" ] && [ -f "$t/backup/two words.txt" ] && [ ! -e "$t/backup/skip.md" ]
rc=$?

if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
