"""Who a stdio MCP server runs as: a user that cannot read the mesh's secrets.

The mesh's services mark themselves not dumpable (:mod:`yoke.hardening`), which keeps their
``/proc/<pid>/environ``, ``mem`` and the like from any process of the same user. Root is not
held back by that (``CAP_SYS_PTRACE``), so when the processor runs as root, as it does in a
plain container or a test machine, a stdio server is started as ``YOKE_MCP_STDIO_USER``
(default ``nobody``) instead: through this very file, run as a script by the processor's
interpreter (``python -I -S stdio_user.py USER -- COMMAND...``), which drops to that user (no
supplementary groups, ``no_new_privs`` so no set-user-id program gives root back), gives it a
``HOME`` it can write (its own, or a private directory under the system's temporary one) and a
working directory it can enter, then becomes the server's command. As a script it imports only
the standard library, before and after the drop.

``YOKE_MCP_STDIO_USER=root`` keeps root (for a server that needs it; it can then read the
mesh's secrets). A processor that is not root starts its servers as its own user, whatever
the setting: only root can change user.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import stat
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
    from yoke.settings import Settings

    user = Settings().mcp_stdio_user or DEFAULT_USER
    return None if user in ("root", "0") else user


def server_command(command: list[str], user: str | None = None) -> list[str]:
    """The command that starts a stdio server ``command`` as ``user`` (default: the
    configured one); ``command`` itself when it is to run as this process's own user."""
    user = configured_user() if user is None else user
    if user is None:
        return command
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), user, "--", *command]


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
    when it starts)."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: stdio_user.py USER -- COMMAND...", file=sys.stderr)
        return CANNOT_RUN
    user, command = argv[0], argv[2:]
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
