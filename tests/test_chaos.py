"""Chaos, bounded: about a minute of kills, dropped broker connections and store outages.

The shared RabbitMQ and FerretDB serve other test runs at the same time, so this run breaks only
what it owns: the services' own broker connections (closed through the management API) and a
TCP proxy in front of the store (frozen with SIGSTOP, then killed and started again). The full
run against the real servers is ``make chaos``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.chaos.faults import NotOurServers, check_local_servers, stand_in_faults
from tests.chaos.harness import BOUNDED, Servers, run_chaos
from tests.chaos.load import Line, line_text
from tests.chaos.verdict import FaultRecord, Report, account
from tests.support.processes import ROOT, free_port
from tests.support.tcp_proxy import ProxyProcess
from yoke.models import Message, MessageMeta, TextPart


def _through(url: str, port: int) -> str:
    """``url`` with its host and port replaced by the local proxy's (credentials kept)."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (userinfo + "@" if userinfo else "") + f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


@pytest.mark.slow
# It stops and restarts the shared RabbitMQ and FerretDB: nothing else may run meanwhile.
@pytest.mark.serial
async def test_every_line_is_answered_once_and_in_order_through_bounded_chaos(
    servers: tuple[str, str, str], tmp_path: Path
) -> None:
    amqp_url, mongodb_url, management_url = servers
    store = urlsplit(mongodb_url)
    proxy = ProxyProcess(
        store.hostname or "127.0.0.1", store.port or 27017, free_port(), tmp_path / "proxy.log"
    )
    proxy.start()
    chaos_servers = Servers(amqp_url, mongodb_url, management_url)
    try:
        report = await run_chaos(
            BOUNDED,
            chaos_servers,
            tmp_path,
            lambda vhost: stand_in_faults(management_url, chaos_servers.auth, vhost, proxy),
            services_mongodb_url=_through(mongodb_url, proxy.port),
        )
    finally:
        proxy.kill()
    print(report.render())
    assert report.ok, "\n" + report.render()
    assert [f.kind for f in report.faults].count("kill") == 5


# --- the harness itself: it must be able to see a failure --------------------------------


def _line(forum: int, index: int) -> Line:
    line = Line(forum, f"forum-{forum}", index, f"key-{index}", float(index))
    line.message_id = f"m{forum}-{index}"
    return line


def _person(line: Line, seq: int) -> Message:
    return Message(
        id=line.message_id or "",
        conversation_id=line.forum_id,
        seq=seq,
        author_actor_id="person",
        parts=[TextPart(text=line_text(line.forum, line.index))],
    )


def _answer(line: Line, seq: int, answer_id: str) -> Message:
    return Message(
        id=answer_id,
        conversation_id=line.forum_id,
        seq=seq,
        author_actor_id="echo",
        role="agent",
        parts=[TextPart(text=line_text(line.forum, line.index))],
        meta=MessageMeta(in_reply_to=line.message_id),
    )


def test_accounting_finds_lost_duplicated_and_reordered_answers() -> None:
    one, two, three, four = (_line(0, n) for n in (1, 2, 3, 4))
    forum = [
        _person(one, 1),
        _person(two, 2),
        _answer(two, 3, "a2"),  # line 2 answered before line 1
        _answer(one, 4, "a1"),
        _person(three, 5),
        _answer(three, 6, "a3"),
        _answer(three, 7, "a3-again"),
        _person(four, 8),  # never answered
    ]
    accounting = account([one, two, three, four], {"forum-0": forum})
    assert accounting.lines == 4
    assert [entry.split(":")[0] for entry in accounting.lost] == ["forum 0 line 4 (id m0-4)"]
    assert len(accounting.duplicated) == 1 and "line 3" in accounting.duplicated[0]
    assert accounting.out_of_order == [
        "forum 0: the answer to line 1 (seq 4) comes after the answer to line 2 (seq 3)"
    ]
    report = Report(1, 1.0, accounting, [FaultRecord("kill", "kill -9 x", 0.0, 1.0, 3.5)])
    assert not report.ok
    header, _, row = report.table().splitlines()
    assert "longest recovery" in header
    assert [cell.strip() for cell in row.strip("| ").split("|")] == (
        ["4", "1", "0", "0", "1", "1", "1", "2.5 s"]
    )


def test_accounting_of_a_clean_run_is_ok() -> None:
    lines = [_line(1, n) for n in (1, 2)]
    forum = [_person(lines[0], 1), _answer(lines[0], 2, "a"), _person(lines[1], 3)]
    forum.append(_answer(lines[1], 4, "b"))
    report = Report(1, 1.0, account(lines, {"forum-1": forum}), [])
    assert report.ok, report.render()


def test_chaos_refuses_servers_it_did_not_start() -> None:
    with pytest.raises(NotOurServers, match="YOKE_AMQP_URL"):
        check_local_servers({"YOKE_AMQP_URL": "amqp://guest:guest@elsewhere:5672/"})
    result = subprocess.run(
        [sys.executable, "-m", "tests.chaos"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "YOKE_MONGODB_URL": "mongodb://elsewhere:27017/"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "not ours to restart" in result.stderr
