#!/bin/bash
cd /app
echo separate > result.txt
rm -f seed.txt
grep -o 'containers/[0-9a-f]*' /proc/self/mountinfo | head -n 1 > agent-container
ls -A /tests | grep -c . > agent-saw-tests
echo agent > /tmp/agent-tmp
mkdir -p /logs/artifacts && echo note > /logs/artifacts/note.txt
