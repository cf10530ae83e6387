#!/bin/bash
# One line per run (the verifier counts them), then a while before the step ends (a test kills the worker
# that runs this step meanwhile).
echo run >> /app/step-runs.txt
sleep 6
echo done > /app/done.txt
