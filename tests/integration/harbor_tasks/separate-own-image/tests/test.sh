#!/bin/bash
# Runs in the verifier's own image (tests/Dockerfile). Reward: the handed-over /app/result.txt says
# "separate". The other keys show where it ran: its own image, without what the agent left outside the
# artifact, once per rollout.
echo run >> /logs/verifier/runs.txt
ok=0; [ "$(cat /app/result.txt 2>/dev/null)" = separate ] && ok=1
image=0; [ "$(cat /etc/harbor-image)" = verifier ] && image=1
only=1; [ -e /app/not-handed.txt ] && only=0
runs=$(grep -c . /logs/verifier/runs.txt)
printf '{"reward": %s, "verifier_image": %s, "only_artifacts": %s, "verifier_runs": %s}\n' \
    "$ok" "$image" "$only" "$runs" > /logs/verifier/reward.json
