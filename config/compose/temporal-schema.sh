#!/bin/sh
# Temporal's schema on the stack's PostgreSQL, as Temporal's own compose files set it up (temporalio/
# samples-server compose/scripts/setup-postgres.sh): temporal-sql-tool from temporalio/admin-tools, run to
# completion before the server starts (docker-compose.yml's temporal-schema job).
#
# Every start: a database that `create` makes is new and gets the base schema (setup-schema -v 0.0); one
# that exists already keeps its own; update-schema then brings both to the admin-tools release's versions
# (it applies only the versions above the database's, so a re-run or an upgraded image is safe).
set -eu
: "${POSTGRES_SEEDS:?}" "${POSTGRES_USER:?}" "${SQL_PASSWORD:?}"
PORT="${DB_PORT:-5432}"
SCHEMA=/etc/temporal/schema/postgresql/v12

sql() {
    temporal-sql-tool --plugin postgres12 --ep "$POSTGRES_SEEDS" -u "$POSTGRES_USER" -p "$PORT" --db "$@"
}

for db in temporal:temporal temporal_visibility:visibility; do
    name="${db%%:*}"
    dir="${db##*:}"
    if sql "$name" create; then
        echo "database $name created"
        sql "$name" setup-schema -v 0.0
    else
        echo "database $name exists (or cannot be created: update-schema says which)"
    fi
    sql "$name" update-schema -d "$SCHEMA/$dir/versioned"
done
echo "Temporal's schema is up to date"
