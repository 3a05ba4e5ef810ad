#!/bin/bash
# Runs once, when the primary's data directory is initialised: lets the
# fleet's replica connect for streaming replication (pg_basebackup, then
# the WAL stream). The image's own rule ("host all all all") does not match
# replication connections.
set -e
echo "host replication all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
