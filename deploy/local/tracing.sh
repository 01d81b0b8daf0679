#!/usr/bin/env bash
# Jaeger for the mesh's traces on this machine (`make tracing`), built from the Go module proxy
# as services.sh builds FerretDB: no Docker engine, no release download.
#
#   tracing.sh build   only the binary (.local/bin/jaeger), if missing or of another version:
#                      `make test` needs it (tests/support/jaeger.py runs one per test module)
#                      and `make compose-check` copies it into its jaeger stand-in image
#   tracing.sh start   build, then run Jaeger v2 on 127.0.0.1 with deploy/local/jaeger.yaml
#                      (traces in memory): UI and query API on YOKE_JAEGER_UI_PORT (16686),
#                      OTLP gRPC on YOKE_JAEGER_OTLP_GRPC_PORT (4317) and HTTP on
#                      YOKE_JAEGER_OTLP_HTTP_PORT (4318); prints where to look and what to set
#   tracing.sh stop    stops the Jaeger `start` started (pid file)
#   tracing.sh run-env for `make run`: prints `export OTEL_EXPORTER_OTLP_ENDPOINT=...` when
#                      the Jaeger `start` started answers and the variable is unset (so the
#                      mesh traces to it), and says on stderr where its traces are
#
# YOKE_TRACING_DIR moves its log and pid file (default .local/jaeger).
# YOKE_JAEGER_BUILD_DEADLINE bounds the build (default 3600 s: a first build compiles the whole
# OpenTelemetry Collector); YOKE_SERVICES_DEADLINE how long `start` waits for it to answer.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
local_dir="$root/.local"
dir="${YOKE_TRACING_DIR:-$local_dir/jaeger}"
bin="$local_dir/bin/jaeger"
# The Go module's version is v1 (the repository's tags); the program it builds is Jaeger v2,
# released with it as v2.12.0 (the official image docker-compose.yml runs has that tag).
module_version="v1.75.0"
jaeger_version="v2.12.0"
config="$root/deploy/local/jaeger.yaml"
ui_port="${YOKE_JAEGER_UI_PORT:-16686}"
otlp_grpc_port="${YOKE_JAEGER_OTLP_GRPC_PORT:-4317}"
otlp_http_port="${YOKE_JAEGER_OTLP_HTTP_PORT:-4318}"
query_grpc_port="${YOKE_JAEGER_QUERY_GRPC_PORT:-16685}"
build_deadline="${YOKE_JAEGER_BUILD_DEADLINE:-3600}"
deadline_seconds="${YOKE_SERVICES_DEADLINE:-60}"
mkdir -p "$local_dir/bin" "$dir"

say() { printf '[tracing] %s\n' "$*"; }
die() { printf '[tracing] error: %s\n' "$*" >&2; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

built() { [ -x "$bin" ] && [ "$(cat "$bin.version" 2>/dev/null)" = "$jaeger_version" ]; }

# The approved way to build the program (the module list: `go get -tool` in a module of our
# own): a throwaway module under .local/ requiring only Jaeger, so minimal version selection
# takes exactly the versions Jaeger's own go.mod names. Static (CGO_ENABLED=0, as Jaeger's
# release builds), so the same binary runs in compose-check's Debian stand-in; the version is
# stamped as Jaeger's Makefile does (-X .../internal/version.latestVersion).
build() {
    built && return 0
    command -v go >/dev/null || die "Go is needed to build Jaeger (the Go module proxy); install Go or run 'docker compose up -d jaeger'"
    local module="$local_dir/jaeger-module" log="$local_dir/jaeger-build.log"
    local started pid elapsed report=60
    say "building Jaeger $jaeger_version (module github.com/jaegertracing/jaeger $module_version) from the Go module proxy"
    say "first time: many minutes on 2 cores (later builds reuse Go's build cache); log: $log"
    mkdir -p "$module"
    started=$(date +%s)
    # In a process group of its own (job control on), so that the deadline stops the compilers
    # go build started too, not only go build.
    set -m
    (
        cd "$module"
        [ -f go.mod ] || go mod init yoke.local/jaeger-build
        go get -tool "github.com/jaegertracing/jaeger/cmd/jaeger@$module_version"
        CGO_ENABLED=0 go build -trimpath \
            -ldflags "-X github.com/jaegertracing/jaeger/internal/version.latestVersion=$jaeger_version" \
            -o "$bin.tmp" github.com/jaegertracing/jaeger/cmd/jaeger
    ) >"$log" 2>&1 &
    pid=$!
    set +m
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        elapsed=$(($(date +%s) - started))
        if [ "$elapsed" -ge "$build_deadline" ]; then
            kill -TERM -- "-$pid" 2>/dev/null || true
            die "the Jaeger build passed its deadline (${build_deadline}s, YOKE_JAEGER_BUILD_DEADLINE); see $log"
        fi
        if [ "$elapsed" -ge "$report" ]; then
            say "still building ($((elapsed / 60)) min)"
            report=$((report + 60))
        fi
    done
    wait "$pid" || die "the Jaeger build failed; see $log"
    mv "$bin.tmp" "$bin"
    echo "$jaeger_version" >"$bin.version"
    say "built $bin ($(du -h "$bin" | cut -f1)) in $(($(date +%s) - started)) s"
}

running() { [ -f "$dir/jaeger.pid" ] && kill -0 "$(cat "$dir/jaeger.pid")" 2>/dev/null; }

where() {
    say "Jaeger: http://127.0.0.1:$ui_port (query API: /api/v3/traces/{traceId}, /api/v3/services; log: ${dir#"$root"/}/jaeger.log)"
    say "traces from the mesh: export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$otlp_http_port before 'make run' or 'yoke up'"
}

start() {
    build
    if running; then
        say "already running (pid $(cat "$dir/jaeger.pid"))"
        where
        return 0
    fi
    local port
    for port in "$ui_port" "$otlp_grpc_port" "$otlp_http_port" "$query_grpc_port"; do
        port_open "$port" && die "something else answers on 127.0.0.1:$port (set YOKE_JAEGER_*_PORT; see $0)"
    done
    say "starting Jaeger $jaeger_version on 127.0.0.1 (config: deploy/local/jaeger.yaml, traces in memory)"
    YOKE_JAEGER_UI_PORT="$ui_port" YOKE_JAEGER_OTLP_GRPC_PORT="$otlp_grpc_port" \
        YOKE_JAEGER_OTLP_HTTP_PORT="$otlp_http_port" YOKE_JAEGER_QUERY_GRPC_PORT="$query_grpc_port" \
        nohup "$bin" --config "$config" >"$dir/jaeger.log" 2>&1 &
    echo $! >"$dir/jaeger.pid"
    local waited=0
    until curl -fs "http://127.0.0.1:$ui_port/api/v3/services" >/dev/null 2>&1 && port_open "$otlp_http_port"; do
        running || die "Jaeger exited; see $dir/jaeger.log"
        [ "$waited" -ge "$((deadline_seconds * 10))" ] && die "Jaeger did not answer within ${deadline_seconds}s; see $dir/jaeger.log"
        sleep 0.1
        waited=$((waited + 1))
    done
    where
}

stop() {
    if running; then
        local pid
        pid=$(cat "$dir/jaeger.pid")
        say "stopping Jaeger (pid $pid; its traces were in memory only)"
        kill "$pid"
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$dir/jaeger.pid"
}

# Tracing stays off unless asked for: an endpoint already set is kept, and only a Jaeger this
# script runs (`make tracing`) turns it on.
run_env() {
    if [ -n "${OTEL_EXPORTER_OTLP_ENDPOINT:-}" ]; then
        say "the mesh sends its traces to $OTEL_EXPORTER_OTLP_ENDPOINT (OTEL_EXPORTER_OTLP_ENDPOINT)" >&2
    elif running && port_open "$otlp_http_port"; then
        echo "export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$otlp_http_port"
        say "make tracing's Jaeger answers: the mesh traces to it; traces at http://127.0.0.1:$ui_port" >&2
    else
        say "tracing off ('make tracing' runs Jaeger, then 'make run' traces to it)" >&2
    fi
}

case "${1:-start}" in
    build) build ;;
    start) start ;;
    stop) stop ;;
    run-env) run_env ;;
    *) die "usage: $0 build|start|stop|run-env" ;;
esac
