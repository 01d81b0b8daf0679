"""How a root processor starts a stdio MCP server: as another user, and no way back to root.

``yoke.tools.stdio_user`` run as a script (as the processor runs it) before the server's
command: here the command is ``sh`` printing what the server would be.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from yoke.tools.stdio_user import CANNOT_RUN, NOT_FOUND, server_command

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root changes user")

# What the server sees of itself: user, groups, HOME (and whether it can write there), its
# working directory, and whether set-user-id programs could give it root again.
REPORT = (
    'echo "$(id -u) $(id -g) [$(id -G)] $HOME $USER"; touch "$HOME/x" && echo writable; pwd; '
    "grep NoNewPrivs /proc/self/status"
)


def run(user: str, *command: str, cwd: str = "/") -> tuple[int, str]:
    """``command`` started as the processor starts a server, from root's HOME and ``cwd``."""
    done = subprocess.run(
        server_command(list(command), user),
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "HOME": "/root"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout + done.stderr


def test_a_server_runs_as_nobody_with_its_group_only_a_home_and_no_new_privileges() -> None:
    code, out = run("nobody", "sh", "-c", REPORT, cwd="/root")
    assert code == 0, out
    who, writable, where, privileges = out.splitlines()
    uid, gid, rest = who.split(" ", 2)
    groups, home, user = rest.rsplit(" ", 2)
    assert (uid, user) == ("65534", "nobody")
    assert groups == f"[{gid}]"  # no supplementary group (root's would be 0)
    assert home != "/root" and writable == "writable"  # /root is not nobody's
    assert where == home  # /root cannot be entered: the server starts in its HOME
    assert privileges.split() == ["NoNewPrivs:", "1"]


def test_a_user_that_does_not_exist_or_a_missing_command_is_said_and_nothing_runs() -> None:
    code, out = run("no-such-user-here", "sh", "-c", "echo ran")
    assert code == CANNOT_RUN and "ran" not in out
    assert "there is no user 'no-such-user-here'" in out
    code, out = run("nobody", "no-such-command-here")
    assert code == NOT_FOUND and "not found: 'no-such-command-here'" in out


def test_root_keeps_root_only_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YOKE_MCP_STDIO_USER", "")
    assert server_command(["srv"])[-3:] == ["nobody", "--", "srv"]
    monkeypatch.setenv("YOKE_MCP_STDIO_USER", "mcp")
    assert server_command(["srv"])[-3:] == ["mcp", "--", "srv"]
    monkeypatch.setenv("YOKE_MCP_STDIO_USER", "root")
    assert server_command(["srv"]) == ["srv"]
