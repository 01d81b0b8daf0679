#!/usr/bin/env bash
# Makes sure headless Chromium and its WebDriver are there for the console's browser test
# (tests/gateway/test_console.py): Debian's `chromium` and `chromium-driver`, installed with apt-get
# as root when missing; a no-op when both are present. Elsewhere it says what to install.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
local_dir="$root/.local"
mkdir -p "$local_dir"

say() { printf '[browser] %s\n' "$*"; }

if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    say "chromium and chromium-driver are missing: install them (Debian: apt-get install chromium chromium-driver) or the console test fails"
    exit 0
fi
say "apt-get update"
apt-get update -q >"$local_dir/apt-browser.log" 2>&1 || { say "apt-get update failed; see $local_dir/apt-browser.log"; exit 1; }
say "installing chromium and chromium-driver with apt-get (log: $local_dir/apt-browser.log)"
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver \
    >>"$local_dir/apt-browser.log" 2>&1 || { say "apt-get install failed; see $local_dir/apt-browser.log"; exit 1; }
