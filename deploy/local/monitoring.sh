#!/usr/bin/env bash
# Prometheus for the mesh on this machine (`make monitoring`), from Debian's `prometheus` package.
#
#   monitoring.sh install   install Debian's prometheus (it ships promtool) with apt-get, only
#                           when missing (Debian, root); Debian's own instance is not kept running
#   monitoring.sh start     install, then run a Prometheus of our own on 127.0.0.1:$PORT
#                           (YOKE_PROMETHEUS_PORT, default 9090) with
#                           deploy/prometheus/prometheus.yml rewritten for local ports and
#                           deploy/prometheus/alerts.yml, data in .local/prometheus; prints its URL
#   monitoring.sh stop      stops the Prometheus `start` started (pid file in .local/)
#
# YOKE_PROMETHEUS_DIR moves its configuration, data, log and pid file (default .local/prometheus).
# YOKE_REPLICAS=N also scrapes replicas 1..N-1 of every service (metrics port + 10 k).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
local_dir="$root/.local"
dir="${YOKE_PROMETHEUS_DIR:-$local_dir/prometheus}"
python="$root/.venv/bin/python"
port="${YOKE_PROMETHEUS_PORT:-9090}"
deadline_seconds="${YOKE_SERVICES_DEADLINE:-60}"
mkdir -p "$local_dir" "$dir"

say() { printf '[monitoring] %s\n' "$*"; }
die() { printf '[monitoring] error: %s\n' "$*" >&2; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

install() {
    if command -v prometheus >/dev/null && command -v promtool >/dev/null; then return 0; fi
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
        || die "prometheus and promtool are missing and this is not Debian as root: install Prometheus 2.x (it ships promtool) or use 'docker compose up -d prometheus'"
    # Waits for another apt-get (another make target) to let go of dpkg's lock.
    say "apt-get update"
    apt-get -o DPkg::Lock::Timeout=600 update -q >"$local_dir/apt.log" 2>&1 || die "apt-get update failed; see $local_dir/apt.log"
    say "installing prometheus with apt-get (log: $local_dir/apt.log)"
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends prometheus \
        >>"$local_dir/apt.log" 2>&1 || die "apt-get install prometheus failed; see $local_dir/apt.log"
    # The package may start its own instance on :9090 (systemd): this project runs its own.
    if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
        say "stopping and disabling the prometheus service the package started"
        systemctl disable --now prometheus >/dev/null 2>&1 || true
    elif [ -x /etc/init.d/prometheus ] && /etc/init.d/prometheus status >/dev/null 2>&1; then
        say "stopping the prometheus service the package started"
        /etc/init.d/prometheus stop >/dev/null 2>&1 || true
    fi
}

running() { [ -f "$dir/prometheus.pid" ] && kill -0 "$(cat "$dir/prometheus.pid")" 2>/dev/null; }

start() {
    [ -x "$python" ] || die "no virtualenv: run 'make install' first"
    install
    if running; then
        say "already running (pid $(cat "$dir/prometheus.pid")): http://127.0.0.1:$port"
        return 0
    fi
    port_open "$port" && die "something else answers on 127.0.0.1:$port (set YOKE_PROMETHEUS_PORT)"
    "$python" -m yoke.cli.monitoring \
        --source "$root/deploy/prometheus/prometheus.yml" \
        --rules "$root/deploy/prometheus/alerts.yml" \
        --replicas "${YOKE_REPLICAS:-1}" \
        --out "$dir/prometheus.yml"
    promtool check config "$dir/prometheus.yml" >"$dir/check.log" 2>&1 \
        || die "promtool check config failed; see $dir/check.log"
    say "starting Prometheus on 127.0.0.1:$port (log: $dir/prometheus.log, data: $dir/data)"
    nohup prometheus --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/data" \
        --storage.tsdb.retention.time=7d --web.listen-address="127.0.0.1:$port" \
        >"$dir/prometheus.log" 2>&1 &
    echo $! >"$dir/prometheus.pid"
    local waited=0
    until curl -fs "http://127.0.0.1:$port/-/ready" >/dev/null 2>&1; do
        running || die "Prometheus exited; see $dir/prometheus.log"
        [ "$waited" -ge "$((deadline_seconds * 10))" ] && die "Prometheus not ready within ${deadline_seconds}s; see $dir/prometheus.log"
        sleep 0.1
        waited=$((waited + 1))
    done
    say "Prometheus: http://127.0.0.1:$port (targets: http://127.0.0.1:$port/targets, alerts: http://127.0.0.1:$port/alerts)"
}

stop() {
    if running; then
        local pid
        pid=$(cat "$dir/prometheus.pid")
        say "stopping Prometheus (pid $pid)"
        kill "$pid"
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$dir/prometheus.pid"
}

case "${1:-start}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    *) die "usage: $0 install|start|stop" ;;
esac
