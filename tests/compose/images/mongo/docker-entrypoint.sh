#!/bin/bash
# The mongo image's entry point, played by FerretDB on PostgreSQL. As the official one does:
# on a first start (an empty /data/db) the root user from MONGO_INITDB_ROOT_USERNAME/PASSWORD
# is made and every /docker-entrypoint-initdb.d/*.js is run with mongosh against a server
# nobody else can reach yet (here: a Unix socket only); then the server listens on :27017.
set -euo pipefail

pgdata=/data/db/postgresql
socket_dir=/run/postgresql
postgres_bin=/usr/lib/postgresql/15/bin
pg_url="postgres://postgres@/ferretdb?host=$socket_dir&pool_max_conns=250"

as_postgres() { runuser -u postgres -- "$@"; }

first_start=0
if [ ! -s "$pgdata/PG_VERSION" ]; then
    first_start=1
    mkdir -p "$pgdata"
    chown postgres:postgres "$pgdata"
    # Reached only through its Unix socket inside this container: trust is local-only.
    as_postgres "$postgres_bin/initdb" -D "$pgdata" --auth=trust --encoding=UTF8 >/dev/null
fi

as_postgres "$postgres_bin/pg_ctl" -D "$pgdata" -w -l "$pgdata/server.log" \
    -o "-c listen_addresses='' -k $socket_dir -c max_connections=300" start >/dev/null
if [ "$first_start" = 1 ]; then
    as_postgres psql -h "$socket_dir" -qc "CREATE DATABASE ferretdb"
fi

ferretdb_pid=
stop() {
    [ -n "$ferretdb_pid" ] && kill -TERM "$ferretdb_pid" 2>/dev/null && wait "$ferretdb_pid" || true
    as_postgres "$postgres_bin/pg_ctl" -D "$pgdata" -m fast -w stop >/dev/null || true
    exit 0
}
trap stop TERM INT

ferretdb() { # extra flags...
    /usr/local/bin/ferretdb --handler=postgresql --postgresql-url="$pg_url" \
        --state-dir=/data/db --telemetry=disable --debug-addr=- --test-enable-new-auth "$@" &
    ferretdb_pid=$!
}

if [ "$first_start" = 1 ] && [ -n "${MONGO_INITDB_ROOT_USERNAME:-}" ]; then
    init_socket=/tmp/mongodb-init.sock
    ferretdb --listen-addr= --listen-unix="$init_socket" --setup-database=admin \
        --setup-username="$MONGO_INITDB_ROOT_USERNAME" \
        --setup-password="${MONGO_INITDB_ROOT_PASSWORD:?MONGO_INITDB_ROOT_PASSWORD is not set}"
    for _ in $(seq 1 300); do [ -S "$init_socket" ] && break; sleep 0.2; done
    for script in /docker-entrypoint-initdb.d/*.js; do
        [ -e "$script" ] || continue
        echo "docker-entrypoint.sh: running $script"
        mongosh --quiet "mongodb://${init_socket//\//%2F}/${MONGO_INITDB_DATABASE:-test}" \
            --username "$MONGO_INITDB_ROOT_USERNAME" --password "$MONGO_INITDB_ROOT_PASSWORD" \
            --authenticationDatabase admin /usr/local/share/ferretdb-init.js "$script"
    done
    kill -TERM "$ferretdb_pid"
    wait "$ferretdb_pid" || true
    rm -f "$init_socket"
fi

ferretdb --listen-addr=:27017
# mongod's own line once it listens: what clients such as testcontainers wait for.
for _ in $(seq 1 300); do
    if (exec 3<>/dev/tcp/127.0.0.1/27017) 2>/dev/null; then
        echo '{"msg":"Waiting for connections","attr":{"port":27017,"ssl":"off"}}'
        break
    fi
    sleep 0.2
done
wait "$ferretdb_pid" || true
stop
