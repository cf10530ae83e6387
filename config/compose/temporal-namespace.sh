#!/bin/sh
# The namespace the stack's runs use, created once the server is healthy (Temporal's server image, unlike
# auto-setup, creates none; Temporal's compose files run the same step from temporalio/admin-tools).
# Idempotent: an existing namespace is left as it is.
set -eu
NS="${TEMPORAL_NAMESPACE:-default}"
if temporal operator namespace describe -n "$NS" >/dev/null 2>&1; then
    echo "namespace $NS exists"
else
    temporal operator namespace create -n "$NS" --retention "${TEMPORAL_RETENTION:-72h}"
    echo "namespace $NS created"
fi
