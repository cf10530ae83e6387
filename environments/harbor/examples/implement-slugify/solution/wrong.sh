#!/bin/bash
# Keeps leading and trailing dashes.
cat > /app/textutil/slug.py <<'EOF'
import re


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower())
EOF
