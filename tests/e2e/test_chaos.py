"""Chaos, bounded: about a minute of kills, dropped broker connections and store outages; and
about two minutes of the tools scenario (tests/chaos/tools.py).

The shared RabbitMQ and FerretDB serve other test runs at the same time, so the echo run breaks
only what it owns: the services' own broker connections (closed through the management API) and
a TCP proxy in front of the store (frozen with SIGSTOP, then killed and started again). The tools
run gets a RabbitMQ node of its own (tests/support/rabbit_node.py), which it restarts for real,
while both processor replicas and the tool worker are killed with ``kill -9``. The full runs
against the real servers are ``make chaos`` and ``make chaos CHAOS_ARGS=--tools``.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.chaos.faults import (
    NotOurServers,
    check_local_servers,
    own_node_faults,
    stand_in_faults,
)
from tests.chaos.harness import BOUNDED, BOUNDED_TOOLS, Servers, run_chaos
from tests.chaos.load import Line, line_text
from tests.chaos.runs import ToolRun
from tests.chaos.tools import KINDS, Interruption, account_tools
from tests.chaos.verdict import FaultRecord, Report, account
from tests.support import rabbit_node
from tests.support.processes import ROOT, free_port
from tests.support.tcp_proxy import ProxyProcess
from yoke.core.models import Message, MessageMeta, TextPart, ToolCallPart, ToolResultPart


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


@pytest.mark.slow
# Its own broker restarted, processes killed six times: it cannot share the machine.
@pytest.mark.serial
async def test_every_tool_call_ends_once_and_runs_once_through_bounded_chaos(
    servers: tuple[str, str, str], tmp_path: Path
) -> None:
    """Two processor replicas and the worker killed twice each, RabbitMQ restarted, while
    every line needs stdio and HTTP MCP calls plus a worker's, a slow MCP or a gated call."""
    rabbit_node.require()
    with rabbit_node.RabbitNode.temporary() as node:
        report = await run_chaos(
            BOUNDED_TOOLS,
            Servers(node.amqp_url, servers[1], node.management_url),
            tmp_path,
            lambda _vhost: own_node_faults(node, 3.0),
        )
    print(report.render())
    tools = report.tools
    assert tools is not None
    assert (tools.ended_twice, tools.not_ended, tools.ran_twice) == ([], [], []), report.render()
    assert (tools.runs_without_call, tools.answered_without_run) == ([], []), report.render()
    assert tools.open_left == [] and tools.lost == 0, report.render()
    assert tools.calls == tools.ended > 0 and set(tools.answers) == {1}, report.render()
    assert report.ok, "\n" + report.render()
    kinds = [f.kind for f in report.faults]
    assert (kinds.count("kill"), kinds.count("broker")) == (6, 1), report.render()


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


# --- the tools accounting: calls, results and runs -----------------------------------------


def _call_line(forum: str, seq: int, calls: list[tuple[str, str, str]]) -> Message:
    return Message(
        id=f"calls-{seq}",
        conversation_id=forum,
        seq=seq,
        author_actor_id="agent",
        role="agent",
        parts=[ToolCallPart(call_id=c, name=name, input={"tag": tag}) for c, name, tag in calls],
    )


def _results(forum: str, seq: int, call_ids: list[str], *, error: bool = False) -> Message:
    return Message(
        id=f"results-{seq}",
        conversation_id=forum,
        seq=seq,
        author_actor_id="system",
        parts=[
            ToolResultPart(call_id=c, name="t", output=f"ran {c}", is_error=error) for c in call_ids
        ],
    )


def test_tool_accounting_finds_calls_ended_twice_never_ended_and_run_twice() -> None:
    worker = "chaos-w"
    monologue = [
        _call_line("m", 1, [("a", "cstdio__tally", "t-a"), ("b", worker, "t-b")]),
        _results("m", 2, ["a"]),
        _results("m", 3, ["a", "b"]),  # a: ended twice
        _call_line("m", 4, [("c", "chttp__tally", "t-c"), ("d", worker, "t-d")]),
        _results("m", 5, ["d"]),  # c: never ended
        _call_line("m", 6, [("e", worker, "t-e"), ("f", "cstdio__tally", "t-f")]),
        _results("m", 7, ["e", "f"]),  # f: answered, though the tool never ran it
    ]

    def run(tag: str, pid: int, at: float, tool: str = worker) -> ToolRun:
        return ToolRun(tag=tag, tool=tool, pid=pid, call_id=tag, idempotency_key="k", at=at)

    runs = [
        run("t-a", 1, 1.0, "cstdio__tally"),
        run("t-c", 1, 1.0, "chttp__tally"),
        run("t-c", 2, 2.0, "chttp__tally"),  # an MCP call run twice: never allowed
        run("t-b", 7, 1.0),
        run("t-b", 8, 9.0),  # worker 7 was killed in between: allowed
        run("t-d", 8, 10.0),
        run("t-d", 8, 11.0),  # no fault in between (worker 8 was killed later): not allowed
        run("t-e", 8, 20.0),
        run("t-e", 9, 30.0),  # the broker went away meanwhile: allowed
        run("t-zzz", 8, 40.0),  # of no call in the store
    ]
    one, two = _line(0, 1), _line(0, 2)
    forum = [_person(one, 1), _answer(one, 2, "x1"), _answer(one, 3, "x2"), _person(two, 4)]
    accounting = account_tools(
        {"m": monologue},
        runs,
        worker,
        killed_workers={7: 5.0, 8: 35.0},
        interruptions=[Interruption(25.0, 26.0)],
        lines=[one, two],
        forums={"forum-0": forum},
        open_left=[],
        stored_ends={"a": "answered", "c": "failed (in its round): 'cut short'"},
    )
    assert (accounting.calls, accounting.ended) == (6, 5)
    assert [entry.split(" ended")[0] for entry in accounting.ended_twice] == [
        "cstdio__tally t-a (call a)"
    ]
    assert accounting.not_ended == ["chttp__tally t-c (call c)"]
    assert accounting.end_without_line == [
        "chttp__tally t-c (call c): failed (in its round): 'cut short'"
    ]
    assert [e.split(" ran")[0] for e in accounting.ran_twice] == [
        "chttp__tally t-c (call c)",
        f"{worker} t-d (call d)",
    ]
    assert [e.split(":")[0] for e in accounting.reruns_excused] == [
        f"{worker} t-b (call b)",
        f"{worker} t-e (call e)",
    ]
    assert accounting.answered_without_run == ["cstdio__tally t-f (call f)"]
    assert [e.split(":")[0] for e in accounting.runs_without_call] == ["t-zzz"]
    assert accounting.runs == Counter({1: 1, 2: 4, 0: 1})
    assert accounting.answers == Counter({2: 1, 0: 1}) and accounting.lost == 1
    assert not accounting.ok
    header, _, row = accounting.table().splitlines()
    assert "runs per call (0/1/2+)" in header
    assert [cell.strip() for cell in row.strip("| ").split("|")] == (
        ["6", "5", "2", "1", "1", "1/1/4", "2", "1/0/1", "1"]
    )


def test_every_kind_of_waiting_call_is_in_a_bounded_tools_run() -> None:
    """Four forums: one of each kind (a worker's, a slow stdio or HTTP MCP call, a gated one)."""
    assert BOUNDED_TOOLS.forums % len(KINDS) == 0
    assert BOUNDED_TOOLS.processor_replicas == 2
