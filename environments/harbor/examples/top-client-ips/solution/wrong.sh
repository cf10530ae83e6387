#!/bin/bash
# Counts, but sorts by fewest requests first.
cd /app
awk '{print $1}' access.log | sort | uniq -c | sort -k1,1n | head -3 | awk '{print $1" "$2}' > top_ips.txt
