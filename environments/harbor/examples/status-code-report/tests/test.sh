#!/bin/bash
# Partial credit: header, each row, order. Writes a flat dict of numbers to reward.json.
python3 - <<'EOF'
import json
lines = open("/app/report.csv").read().split() if __import__("os").path.exists("/app/report.csv") else []
want = ["status,count", "200,8", "404,2", "500,2"]
header = float(bool(lines) and lines[0] == want[0])
rows = sum(r in lines[1:] for r in want[1:]) / 3
order = float(lines == want)
json.dump({"reward": round((header + rows + order) / 3, 4), "header": header, "rows": round(rows, 4),
           "order": order}, open("/logs/verifier/reward.json", "w"))
EOF
