#!/usr/bin/env bash
# Makes sure a RabbitMQ and a MongoDB-wire server answer, for `make run` and `make test`.
#
#   services.sh start   use YOKE_AMQP_URL / YOKE_MONGODB_URL if set, else whatever answers on
#                       127.0.0.1:5672 / :27017, else (Debian, root) install and start RabbitMQ
#                       and FerretDB on PostgreSQL; otherwise explain what is missing.
#   services.sh stop    stops only what `start` started (markers in .local/).
#   services.sh ferretdb-stop|ferretdb-start|rabbitmq-stop-app|rabbitmq-start-app
#                       (for `make chaos`) take a server away and bring it back, again only
#                       one that `start` started; FerretDB comes back exactly as `start` runs it.
#   services.sh ferretdb-build
#                       only the FerretDB binary `start` runs (.local/bin/ferretdb), if missing
#                       (make compose-check copies it into its mongo stand-in image).
#
# Everything it starts logs into .local/ (gitignored), with pid files and start markers.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
local_dir="$root/.local"
python="$root/.venv/bin/python"
ferretdb_version="v1.24.2"
pg_max_connections=300
ferretdb_pool=250
deadline_seconds="${YOKE_SERVICES_DEADLINE:-120}"
mkdir -p "$local_dir/bin"

say() { printf '[services] %s\n' "$*"; }
die() { printf '[services] error: %s\n' "$*" >&2; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

can_install() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }

apt_updated=""
apt_install() {
    local missing=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ -z "$apt_updated" ]; then
        say "apt-get update"
        apt-get update -q >"$local_dir/apt.log" 2>&1 || die "apt-get update failed; see $local_dir/apt.log"
        apt_updated=1
    fi
    say "installing ${missing[*]} with apt-get (log: $local_dir/apt.log)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >>"$local_dir/apt.log" 2>&1 \
        || die "apt-get install ${missing[*]} failed; see $local_dir/apt.log"
}

# Handlers hold a delivery while they wait out a store outage; RabbitMQ's default 30 min
# consumer timeout would close the channel under them (see deploy/rabbitmq/rabbitmq.conf).
consumer_timeout_ms=86400000
# Nothing exposed by accident: AMQP, management and Prometheus listen on loopback only (read
# when RabbitMQ starts; a broker already running keeps its listeners until it restarts).
rabbitmq_loopback=(
    "listeners.tcp.default = 127.0.0.1:5672"
    "management.tcp.ip = 127.0.0.1"
    "prometheus.tcp.ip = 127.0.0.1"
)
configure_rabbitmq() {
    local conf=/etc/rabbitmq/rabbitmq.conf line
    grep -qs "^consumer_timeout = $consumer_timeout_ms" "$conf" \
        || echo "consumer_timeout = $consumer_timeout_ms" >>"$conf"
    for line in "${rabbitmq_loopback[@]}"; do
        grep -qsxF "$line" "$conf" || echo "$line" >>"$conf"
    done
}

start_rabbitmq() {
    apt_install rabbitmq-server
    configure_rabbitmq
    say "enabling RabbitMQ plugins"
    rabbitmq-plugins enable --offline rabbitmq_consistent_hash_exchange rabbitmq_management \
        rabbitmq_prometheus >"$local_dir/rabbitmq-plugins.log" 2>&1 \
        || die "rabbitmq-plugins failed; see $local_dir/rabbitmq-plugins.log"
    say "starting RabbitMQ (rabbitmq-server -detached; its logs: /var/log/rabbitmq)"
    rabbitmq-server -detached >"$local_dir/rabbitmq.log" 2>&1 || die "rabbitmq-server failed; see $local_dir/rabbitmq.log"
    touch "$local_dir/rabbitmq.started"
}

postgres_cluster() { pg_lsclusters -h 2>/dev/null | awk 'NR==1 {print $1" "$2}'; }

# `go install ...ferretdb@v1.24.2` builds, but the binary panics at start-up: the module as the
# proxy serves it lacks build/version/version.txt (it is generated in FerretDB's own checkout).
# So: download the same module with `go mod download`, add that one file, and `go build` it.
build_ferretdb() { # target binary
    say "building FerretDB $ferretdb_version from the Go module proxy (first time: about a minute)"
    local log="$local_dir/ferretdb-build.log" module src="$local_dir/ferretdb-src"
    module=$(go mod download -json "github.com/FerretDB/FerretDB@$ferretdb_version" 2>"$log" \
        | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') || true
    [ -n "$module" ] || die "go mod download of FerretDB failed; see $log"
    rm -rf "$src" && cp -r "$module" "$src" && chmod -R u+w "$src"
    echo "$ferretdb_version" >"$src/build/version/version.txt"
    (cd "$src" && go build -o "$1" ./cmd/ferretdb) >>"$log" 2>&1 || die "FerretDB build failed; see $log"
    rm -rf "$src"
}

start_ferretdb() {
    apt_install postgresql
    command -v go >/dev/null || die "Go is needed to build FerretDB (go install); install Go or run 'docker compose up'"
    local cluster
    cluster=$(postgres_cluster)
    [ -n "$cluster" ] || die "no PostgreSQL cluster found (pg_lsclusters)"
    # FerretDB 1.x can deadlock when its connection pool runs dry (an update holds a connection
    # while it waits for the metadata lock that an insert holds while it waits for a connection),
    # so give it a pool larger than all clients' concurrent operations, and PostgreSQL room for it.
    local conf_dir="/etc/postgresql/${cluster%% *}/${cluster##* }/conf.d" changed=""
    if [ -d "$conf_dir" ] && ! grep -qs "max_connections = $pg_max_connections" "$conf_dir/yoke.conf"; then
        echo "max_connections = $pg_max_connections" >"$conf_dir/yoke.conf"
        changed=1
    fi
    # Loopback only (Debian's default too, pinned here; read when PostgreSQL starts).
    if [ -d "$conf_dir" ] && ! grep -qs "^listen_addresses = 'localhost'" "$conf_dir/yoke-listen.conf"; then
        echo "listen_addresses = 'localhost'" >"$conf_dir/yoke-listen.conf"
    fi
    # shellcheck disable=SC2086
    if ! pg_ctlcluster $cluster status >/dev/null 2>&1; then
        say "starting PostgreSQL $cluster"
        # shellcheck disable=SC2086
        pg_ctlcluster $cluster start || die "could not start PostgreSQL $cluster"
        touch "$local_dir/postgresql.started"
    elif [ -n "$changed" ]; then
        say "restarting PostgreSQL $cluster (max_connections = $pg_max_connections)"
        # shellcheck disable=SC2086
        pg_ctlcluster $cluster restart || die "could not restart PostgreSQL $cluster"
    fi
    set_ferretdb_role_password
    su postgres -c "psql -qtAc \"SELECT 1 FROM pg_database WHERE datname='ferretdb'\"" | grep -q 1 \
        || su postgres -c "psql -qc \"CREATE DATABASE ferretdb OWNER ferretdb\""
    install_gin_twins
    local bin="$local_dir/bin/ferretdb"
    [ -x "$bin" ] || build_ferretdb "$bin"
    launch_ferretdb "$bin"
}

# FerretDB's own indexes are never used by its queries; give each a GIN twin that is (see the
# SQL file). Done on every start of a FerretDB this script runs, also when it is found running.
install_gin_twins() {
    # On stdin (opened by us): the checkout may sit in a directory the postgres user cannot read.
    su postgres -c "cd / && psql -d ferretdb -v ON_ERROR_STOP=1 -q" \
        <"$root/deploy/local/ferretdb-gin-indexes.sql" >"$local_dir/ferretdb-indexes.log" 2>&1 || die "installing FerretDB's GIN index twins failed; see $local_dir/ferretdb-indexes.log"
}

# FerretDB's PostgreSQL role has a random password, kept in .local/ (git-ignored); the
# repository holds none. Each start from this checkout sets it on the role (FerretDB is down
# then), so the file stays right even after another checkout of the project set its own.
pg_password_file="$local_dir/postgresql-ferretdb.password"
ferretdb_role_password() {
    if [ ! -s "$pg_password_file" ]; then
        (umask 077 && head -c 24 /dev/urandom | base64 | tr -d '\n' | tr '+/' '-_' >"$pg_password_file")
    fi
    cat "$pg_password_file"
}

set_ferretdb_role_password() {
    local verb=CREATE
    if su postgres -c "psql -qtAc \"SELECT 1 FROM pg_roles WHERE rolname='ferretdb'\"" | grep -q 1; then
        verb=ALTER
    fi
    # Through stdin, not the command line: the password never shows in the process list.
    printf "\\set pw '%s'\n%s ROLE ferretdb LOGIN PASSWORD :'pw';\n" "$(ferretdb_role_password)" "$verb" \
        | su postgres -c "psql -q -v ON_ERROR_STOP=1" >/dev/null \
        || die "could not set the password of PostgreSQL's ferretdb role"
}

launch_ferretdb() { # binary
    local password
    password=$(ferretdb_role_password)
    say "starting FerretDB on PostgreSQL (log: $local_dir/ferretdb.log)"
    nohup "$1" --handler=postgresql \
        --postgresql-url="postgres://ferretdb:$password@127.0.0.1:5432/ferretdb?pool_max_conns=$ferretdb_pool" \
        --listen-addr=127.0.0.1:27017 --telemetry=disable --log-level=warn \
        --state-dir="$local_dir" --debug-addr=- >"$local_dir/ferretdb.log" 2>&1 &
    echo $! >"$local_dir/ferretdb.pid"
}

wait_for() { # what, python check
    say "waiting for $1 (deadline ${deadline_seconds}s)"
    "$python" "$root/deploy/local/wait_for.py" --deadline "$deadline_seconds" "$2" "$3" \
        || die "$1 did not answer within ${deadline_seconds}s; see the logs in $local_dir"
}

start() {
    [ -x "$python" ] || die "no virtualenv: run 'make install' first"
    local amqp_url="${YOKE_AMQP_URL:-}" mongo_url="${YOKE_MONGODB_URL:-}"
    # tests/deploy/test_tls.py makes its certificates with openssl at test time; tests that
    # run a service days ahead run it under libfaketime (tests/support/clock.py).
    if can_install; then apt_install openssl libfaketime; fi
    if [ -n "$amqp_url" ]; then
        say "YOKE_AMQP_URL is set: using it, starting no RabbitMQ"
    elif port_open 5672; then
        say "something answers on 127.0.0.1:5672: using it as RabbitMQ"
        if [ -f "$local_dir/rabbitmq.started" ]; then
            configure_rabbitmq
            rabbitmqctl eval "application:set_env(rabbit, consumer_timeout, $consumer_timeout_ms)." >/dev/null
        fi
    elif can_install; then
        start_rabbitmq
    else
        die "no RabbitMQ on 127.0.0.1:5672, and this is not Debian as root, so it cannot be installed here.
Start one with 'docker compose up -d rabbitmq mongodb', or set YOKE_AMQP_URL."
    fi
    if [ -n "$mongo_url" ]; then
        say "YOKE_MONGODB_URL is set: using it, starting no MongoDB-wire server"
    elif port_open 27017; then
        say "something answers on 127.0.0.1:27017: using it as the MongoDB-wire server"
        [ -f "$local_dir/ferretdb.pid" ] && install_gin_twins
    elif can_install; then
        start_ferretdb
    else
        die "no MongoDB-wire server on 127.0.0.1:27017, and this is not Debian as root.
Start one with 'docker compose up -d rabbitmq mongodb', or set YOKE_MONGODB_URL."
    fi
    wait_for RabbitMQ amqp "${amqp_url:-amqp://guest:guest@127.0.0.1:5672/}"
    wait_for "the MongoDB-wire server" mongodb "${mongo_url:-mongodb://127.0.0.1:27017/yoke}"
    say "ready"
}

stop_ferretdb() {
    if [ -f "$local_dir/ferretdb.pid" ]; then
        local pid
        pid=$(cat "$local_dir/ferretdb.pid")
        if kill "$pid" 2>/dev/null; then
            say "stopping FerretDB (pid $pid)"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$local_dir/ferretdb.pid"
    fi
}

stop() {
    stop_ferretdb
    if [ -f "$local_dir/postgresql.started" ]; then
        say "stopping PostgreSQL"
        # shellcheck disable=SC2046
        pg_ctlcluster $(postgres_cluster) stop || true
        rm -f "$local_dir/postgresql.started"
    fi
    if [ -f "$local_dir/rabbitmq.started" ]; then
        say "stopping RabbitMQ"
        rabbitmqctl stop >/dev/null 2>&1 || true
        epmd -kill >/dev/null 2>&1 || true  # Erlang's port mapper, started along with RabbitMQ
        rm -f "$local_dir/rabbitmq.started"
    fi
    say "stopped what this script had started"
}

# For `make chaos`: take away and bring back only servers that `start` started itself.
ferretdb_stop() {
    [ -f "$local_dir/ferretdb.pid" ] || die "FerretDB was not started by this script (no $local_dir/ferretdb.pid)"
    stop_ferretdb
}

ferretdb_start() {
    [ -x "$local_dir/bin/ferretdb" ] || die "FerretDB was never built by this script (no $local_dir/bin/ferretdb)"
    if [ -f "$local_dir/ferretdb.pid" ] && kill -0 "$(cat "$local_dir/ferretdb.pid")" 2>/dev/null; then
        die "FerretDB is running already (pid $(cat "$local_dir/ferretdb.pid"))"
    fi
    if port_open 27017; then die "something else answers on 127.0.0.1:27017"; fi
    launch_ferretdb "$local_dir/bin/ferretdb"
    wait_for "the MongoDB-wire server" mongodb "mongodb://127.0.0.1:27017/yoke"
}

rabbitmq_app() { # stop_app|start_app
    [ -f "$local_dir/rabbitmq.started" ] || die "RabbitMQ was not started by this script (no $local_dir/rabbitmq.started)"
    say "rabbitmqctl $1"
    rabbitmqctl "$1" >/dev/null || die "rabbitmqctl $1 failed"
    if [ "$1" = start_app ]; then
        wait_for RabbitMQ amqp "amqp://guest:guest@127.0.0.1:5672/"
    fi
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    ferretdb-stop) ferretdb_stop ;;
    ferretdb-start) ferretdb_start ;;
    ferretdb-build)
        command -v go >/dev/null || die "Go is needed to build FerretDB"
        [ -x "$local_dir/bin/ferretdb" ] || build_ferretdb "$local_dir/bin/ferretdb" ;;
    rabbitmq-stop-app) rabbitmq_app stop_app ;;
    rabbitmq-start-app) rabbitmq_app start_app ;;
    *) die "usage: $0 start|stop|ferretdb-stop|ferretdb-start|ferretdb-build|rabbitmq-stop-app|rabbitmq-start-app" ;;
esac
