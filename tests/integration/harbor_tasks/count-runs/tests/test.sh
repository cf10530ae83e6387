#!/bin/bash
# One line per run of the verifier, then a while before the reward (a test kills the worker meanwhile).
# Full reward only if the solution's step ran exactly once and finished.
echo run >> /app/verifier-runs.txt
sleep 6
steps=$(cat /app/step-runs.txt 2>/dev/null | grep -c .)
runs=$(cat /app/verifier-runs.txt | grep -c .)
ok=0
if [ "$steps" = 1 ] && [ "$(cat /app/done.txt 2>/dev/null)" = done ]; then ok=1; fi
printf '{"reward": %s, "step_runs": %s, "verifier_runs": %s}\n' "$ok" "$steps" "$runs" > /logs/verifier/reward.json
