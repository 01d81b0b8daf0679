"""A real process with its wall clock days ahead (tests/support/clock.py, libfaketime): the
wall clock moves, the monotonic one does not, and the process still speaks to the suite's
MongoDB-wire server and RabbitMQ, and a service starts and stops cleanly under it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pymongo import AsyncMongoClient

from tests.support.clock import libfaketime, shifted_env
from tests.support.mesh import service_env
from tests.support.processes import ServiceProcess

THREE_DAYS = timedelta(days=3).total_seconds()
# A child starts, connects and answers within this (a loaded machine included).
SLACK = 60.0

# The child: its clocks, then one document written and read back, one message published and
# consumed, all timed by its own clocks.
CHILD = """
import asyncio, json, sys, time
from datetime import UTC, datetime
import aio_pika
from pymongo import AsyncMongoClient

async def main(amqp_url, mongodb_url):
    clocks = {"time": time.time(), "now": datetime.now(UTC).timestamp(),
              "monotonic": time.monotonic()}
    started = time.monotonic()
    await asyncio.sleep(0.2)
    slept = time.monotonic() - started
    client = AsyncMongoClient(mongodb_url, serverSelectionTimeoutMS=20000)
    try:
        notes = client.get_default_database()["shifted_notes"]
        await notes.insert_one({"_id": "note", "at": datetime.now(UTC)})
        stored = await notes.find_one({"_id": "note"})
    finally:
        await client.close()
    connection = await aio_pika.connect(amqp_url, timeout=20)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True)
        await channel.default_exchange.publish(
            aio_pika.Message(b"hello from the future", timestamp=datetime.now(UTC)),
            routing_key=queue.name,
        )
        async def first():
            async with queue.iterator() as messages:
                async for message in messages:
                    await message.ack()
                    return message
        message = await asyncio.wait_for(first(), timeout=20)
    print(json.dumps({
        **clocks,
        "slept": slept,
        "stored": stored["at"].replace(tzinfo=UTC).timestamp(),
        "body": message.body.decode(),
        "sent": message.timestamp.replace(tzinfo=UTC).timestamp(),
    }))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def run_shifted(offset: str, *args: str, script: str = CHILD) -> dict[str, float | str]:
    env = {"PATH": "/usr/bin:/bin"}
    child = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**env, **shifted_env(offset)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    answer: dict[str, float | str] = json.loads(child.stdout)
    return answer


async def test_a_child_three_days_ahead_talks_to_both_servers(
    amqp_url: str, mongodb_url: str
) -> None:
    before, monotonic_before = time.time(), time.monotonic()
    child = run_shifted("+3d", amqp_url, mongodb_url)
    after, monotonic_after = time.time(), time.monotonic()

    for clock in ("time", "now", "stored", "sent"):  # what it reads, stores and sends
        shifted = float(child[clock])
        assert before + THREE_DAYS - 1 <= shifted <= after + THREE_DAYS + 1, (clock, shifted)
    # The monotonic clock is the machine's, untouched: no jump for timeouts and timers.
    assert monotonic_before <= float(child["monotonic"]) <= monotonic_after
    assert 0.2 <= float(child["slept"]) < 0.2 + SLACK
    assert child["body"] == "hello from the future"

    # The server kept what the child said: a date three days ahead.
    client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(mongodb_url)
    try:
        note = await client.get_default_database()["shifted_notes"].find_one({"_id": "note"})
    finally:
        await client.close()
    assert note is not None and isinstance(note["at"], datetime)
    assert note["at"].replace(tzinfo=UTC).timestamp() == pytest.approx(float(child["stored"]))


CLOCKS = """
import json, time
from datetime import UTC, datetime
print(json.dumps({"time": time.time(), "now": datetime.now(UTC).isoformat()}))
"""


@pytest.mark.parametrize(
    ("zone", "utc"),
    [("UTC", "2026-03-29 00:59:50"), ("America/New_York", "2026-03-29 04:59:50")],
)
def test_a_child_starts_at_a_given_instant_read_in_its_zone(zone: str, utc: str) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    started = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", CLOCKS],
        env={**env, **shifted_env("@2026-03-29 00:59:50", zone=zone)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    took = time.monotonic() - started
    start = datetime.fromisoformat(utc).replace(tzinfo=UTC)
    now = datetime.fromisoformat(json.loads(child.stdout)["now"])
    assert start <= now <= start + timedelta(seconds=took)


@pytest.mark.parametrize("offset", ["3d", "+3 days", "tomorrow", "@2026-03-29", "+3d; rm"])
def test_an_offset_libfaketime_would_misread_is_refused(offset: str) -> None:
    with pytest.raises(ValueError, match="not a libfaketime offset"):
        shifted_env(offset)


def test_the_library_is_found() -> None:
    library = libfaketime()
    assert library.name == "libfaketime.so.1" and library.is_file()


async def test_the_processor_starts_and_stops_cleanly_three_days_ahead(
    amqp_url: str, mongodb_url: str, tmp_path: Path
) -> None:
    env = {**service_env(amqp_url, mongodb_url), **shifted_env("+3d")}
    processor = ServiceProcess(["-m", "services.processor"], env, tmp_path / "processor.log")
    try:
        await processor.wait_healthy(timeout=120)
        # Its replica document carries its own (shifted) clock.
        client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(mongodb_url)
        try:
            replica = await client.get_default_database()["replicas"].find_one(
                {"service": "processor"}
            )
        finally:
            await client.close()
        assert replica is not None and isinstance(replica["beat"], datetime)
        ahead = replica["beat"].replace(tzinfo=UTC) - datetime.now(UTC)
        assert timedelta(days=3) - timedelta(seconds=SLACK) < ahead < timedelta(days=3, seconds=5)
    finally:
        code = processor.stop()
    assert code == 0, processor.output()[-3000:]
