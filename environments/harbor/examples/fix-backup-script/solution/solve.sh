#!/bin/bash
cat > /app/backup.sh <<'EOF'
#!/bin/bash
dir=$1
mkdir -p "$dir/backup"
for f in "$dir"/*.txt; do
  [ -e "$f" ] && cp -- "$f" "$dir/backup/"
done
EOF
