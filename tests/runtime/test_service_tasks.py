"""A service's background work lives as long as the service serves, and its crash shows."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.support.processes import eventually, free_port
from yoke.core.models import MessagePosted
from yoke.core.settings import Settings
from yoke.runtime.service import Service


@pytest.fixture
async def service(amqp_url: str, mongodb_url: str) -> AsyncIterator[Service]:
    """A service with one event handler (so it declares and consumes shard queues)."""
    settings = Settings(amqp_url=amqp_url, mongodb_url=mongodb_url, metrics_port=free_port())
    service = Service("tasks", settings)

    async def ignore(event: MessagePosted) -> None:
        pass

    service.on_event(MessagePosted, ignore)
    yield service
    if not service.stopping.is_set():
        await service.stop()


async def healthz(service: Service) -> httpx.Response:
    port = service.settings.metrics_port
    async with httpx.AsyncClient(timeout=5) as http:
        return await http.get(f"http://127.0.0.1:{port}/healthz")


async def test_background_work_starts_only_once_the_service_consumes(service: Service) -> None:
    seen: list[list[str]] = []

    async def work() -> None:
        seen.append(await service.problems())
        seen.append([s.queue_name for s in service.bus.subscriptions])
        await service.stopping.wait()

    async def begun() -> bool:
        return bool(seen)

    service.background("recorder", work)
    await service.start()
    await eventually(begun, timeout=10, what="the work to start")
    problems, queues = seen
    assert problems == []  # not "not consuming yet": the broker is there for it
    assert len(queues) == service.settings.shards


async def test_background_work_is_cancelled_and_awaited_on_stop(service: Service) -> None:
    started = asyncio.Event()
    cleaned_up: list[str] = []

    async def work() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # never set: only a cancel ends it
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # stop() must wait for this
            cleaned_up.append("cancelled")
            raise

    service.background("forever", work)
    await service.start()
    await asyncio.wait_for(started.wait(), timeout=10)
    await service.stop()
    assert cleaned_up == ["cancelled"]
    assert await service.problems() == ["stopping"]  # a cancel is no crash


async def test_a_crashed_background_task_turns_healthz_unhealthy_with_its_reason(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    crash = asyncio.Event()

    async def work() -> None:
        await crash.wait()
        raise RuntimeError("lost its way")

    service.background("follow-up scheduler", work)
    await service.start()
    assert (await healthz(service)).status_code == 200
    with caplog.at_level(logging.ERROR, logger="yoke.runtime.service"):
        crash.set()

        async def unhealthy() -> bool:
            return (await healthz(service)).status_code == 503

        await eventually(unhealthy, timeout=10, what="/healthz to say 503")
    body = (await healthz(service)).text
    assert "follow-up scheduler stopped: RuntimeError('lost its way')" in body.splitlines()
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "follow-up scheduler" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)


async def test_background_work_is_registered_before_start(service: Service) -> None:
    await service.start()

    async def work() -> None:
        pass

    with pytest.raises(RuntimeError, match="before"):
        service.background("late", work)
