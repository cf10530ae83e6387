#!/bin/bash
# Runs in a fresh container of the task's image, tests/ copied to /tests. Reward: the handed-over working
# directory holds result.txt = "separate" and no seed.txt. The other keys show where it ran: not the agent's
# container (another container id in the daemon's mounts, none of the agent's /tmp), with /logs/artifacts
# handed over, while the agent never saw /tests.
echo run >> /logs/verifier/runs.txt
ok=0; [ "$(cat /app/result.txt 2>/dev/null)" = separate ] && [ ! -e /app/seed.txt ] && ok=1
me=$(grep -o 'containers/[0-9a-f]*' /proc/self/mountinfo | head -n 1)
apart=0; [ -n "$me" ] && [ -s /app/agent-container ] && [ "$(cat /app/agent-container)" != "$me" ] \
    && [ ! -e /tmp/agent-tmp ] && apart=1
logs=0; [ "$(cat /logs/artifacts/note.txt 2>/dev/null)" = note ] && logs=1
unseen=0; [ "$(cat /app/agent-saw-tests 2>/dev/null)" = 0 ] && unseen=1
runs=$(grep -c . /logs/verifier/runs.txt)
printf '{"reward": %s, "apart": %s, "logs_artifacts": %s, "agent_saw_no_tests": %s, "verifier_runs": %s}\n' \
    "$ok" "$apart" "$logs" "$unseen" "$runs" > /logs/verifier/reward.json
