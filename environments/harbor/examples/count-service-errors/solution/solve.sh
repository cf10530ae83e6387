#!/bin/bash
cd /app
python3 - <<'EOF'
import json, pathlib
out = {p.stem: sum("ERROR" in l for l in p.read_text().splitlines()) for p in pathlib.Path("logs").glob("*.log")}
json.dump(out, open("errors.json", "w"))
EOF
