"""Who a stdio MCP server runs as: a user that cannot read the mesh's secrets.

The mesh's services mark themselves not dumpable (:mod:`yoke.core.hardening`), which keeps their
``/proc/<pid>/environ``, ``mem`` and the like from any process of the same user. Root is not
held back by that (``CAP_SYS_PTRACE``), so when the processor runs as root, as it does in a
plain container or a test machine, a stdio server is started as ``YOKE_MCP_STDIO_USER``
(default ``nobody``) instead: through this very file, run as a script by the processor's
interpreter (``python -I -S stdio_user.py USER -- COMMAND...``), which drops to that user (no
supplementary groups, ``no_new_privs`` so no set-user-id program gives root back), gives it a
``HOME`` it can write (its own, or a private directory under the system's temporary one) and a
working directory it can enter, then becomes the server's command. As a script it imports only
the standard library, before and after the drop.

``stdio_user.py USER --check -- COMMAND...`` only says whether ``USER`` can reach what root
can of ``COMMAND`` (the program, and each argument naming an absolute path that exists): ``yoke
tools add-mcp`` asks it (:func:`unreachable`), so that a server the stdio user cannot run (say,
in a checkout under a mode-0700 home) is refused as it is registered, not only logged by the
processor at each start.

``YOKE_MCP_STDIO_USER=root`` keeps root (for a server that needs it; it can then read the
mesh's secrets). A processor that is not root starts its servers as its own user, whatever
the setting: only root can change user.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile

DEFAULT_USER = "nobody"
# Exit codes of the wrapper, as a shell's: the command could not be run (126) or found (127).
CANNOT_RUN = 126
NOT_FOUND = 127
PR_SET_NO_NEW_PRIVS = 38


def configured_user() -> str | None:
    """The user this process starts stdio servers as, or None for its own."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    from yoke.core.settings import Settings

    user = Settings().mcp_stdio_user or DEFAULT_USER
    return None if user in ("root", "0") else user


def server_command(command: list[str], user: str | None = None) -> list[str]:
    """The command that starts a stdio server ``command`` as ``user`` (default: the
    configured one); ``command`` itself when it is to run as this process's own user."""
    user = configured_user() if user is None else user
    if user is None:
        return command
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), user, "--", *command]


def unreachable(command: list[str], path: str | None = None) -> str | None:
    """Why the configured stdio user cannot run ``command`` as root could (None: it can, or
    servers run as this process's own user). ``path``: the ``PATH`` the server is given."""
    user = configured_user()
    if user is None or not command:
        return None
    env = {"PATH": path or os.environ.get("PATH") or os.defpath}
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__), user, "--check", "--"]
    try:
        done = subprocess.run(
            [*argv, *command], env=env, capture_output=True, text=True, timeout=60, cwd="/"
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"the check as {user!r} could not run: {error}"
    if done.returncode == 0:
        return None
    said = done.stderr.strip().splitlines()
    return said[-1] if said else f"the check as {user!r} failed ({done.returncode})"


def _targets(command: list[str]) -> list[tuple[str, int]]:
    """What of ``command`` root reaches, as (path, access wanted): the program on ``PATH``
    (or as a path), run; each argument that is an absolute path that exists, read."""
    found: list[tuple[str, int]] = []
    program = shutil.which(command[0])
    if program is not None:
        found.append((os.path.abspath(program), os.X_OK))
    for argument in command[1:]:
        if os.path.isabs(argument) and os.path.exists(argument):
            wanted = os.R_OK | os.X_OK if os.path.isdir(argument) else os.R_OK
            found.append((argument, wanted))
    return found


def check(user: str, command: list[str]) -> int:
    """``--check``: 0 when ``user`` reaches all root reaches of ``command``, else a sentence on
    stderr naming what it cannot (126)."""
    targets = _targets(command)
    try:
        become(user)
    except (OSError, LookupError) as error:
        print(f"cannot become {user!r}: {error}", file=sys.stderr)
        return CANNOT_RUN
    for target, wanted in targets:
        if not os.access(target, wanted):
            verb = "run" if wanted == os.X_OK else "read"
            print(
                f"the stdio MCP server user {user!r} (YOKE_MCP_STDIO_USER) cannot {verb} "
                f"{target}: the processor, running as root, starts stdio servers as that user; "
                f"put the server where {user!r} can {verb} it (a directory every user may "
                "enter), or set YOKE_MCP_STDIO_USER=root to keep root",
                file=sys.stderr,
            )
            return CANNOT_RUN
    return 0


def _account(user: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        raise LookupError(f"there is no user {user!r} (YOKE_MCP_STDIO_USER)") from None


def _usable(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _private_home(uid: int) -> str:
    """A directory of this (already unprivileged) user's own, kept between starts."""
    path = os.path.join(tempfile.gettempdir(), f"yoke-mcp-home-{uid}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    found = os.lstat(path)
    if stat.S_ISDIR(found.st_mode) and found.st_uid == uid and not found.st_mode & 0o077:
        return path
    return tempfile.mkdtemp(prefix=f"yoke-mcp-home-{uid}-")  # someone else's: one of ours


def become(user: str) -> None:
    """Drop this process (root) to ``user``: its group only, no way back to root; then give it
    the ``HOME``, ``USER`` and working directory of its own."""
    account = _account(user)
    os.setgroups([])
    os.setgid(account.pw_gid)
    os.setuid(account.pw_uid)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    home = os.environ.get("HOME", "")
    if not _usable(home):
        home = account.pw_dir if _usable(account.pw_dir) else _private_home(account.pw_uid)
    os.environ.update(HOME=home, USER=account.pw_name, LOGNAME=account.pw_name)
    if not os.access(".", os.X_OK):
        os.chdir(home)


def main(argv: list[str]) -> int:
    """``stdio_user.py USER -- COMMAND...``: become ``USER``, then ``COMMAND`` (never returns
    when it starts); ``stdio_user.py USER --check -- COMMAND...``: :func:`check`."""
    checking = len(argv) > 1 and argv[1] == "--check"
    if checking:
        argv = [argv[0], *argv[2:]]
    if len(argv) < 3 or argv[1] != "--":
        print("usage: stdio_user.py USER [--check] -- COMMAND...", file=sys.stderr)
        return CANNOT_RUN
    user, command = argv[0], argv[2:]
    if checking:
        return check(user, command)
    try:
        become(user)
    except (OSError, LookupError) as error:
        print(f"cannot start mcp server as {user!r}: {error}", file=sys.stderr)
        return CANNOT_RUN
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        print(f"mcp server command not found: {command[0]!r}", file=sys.stderr)
        return NOT_FOUND
    except OSError as error:
        print(f"cannot start mcp server {command[0]!r} as {user!r}: {error}", file=sys.stderr)
        return CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
