"""yoke.core.outbound: which addresses an outsider's URL may reach, and a connection that goes to
the address that was checked (no second resolution for DNS rebinding to change), in-process
against a real local server."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.support.tls_servers import Certificates
from tests.support.webhook_receiver import Receiver
from yoke.core.outbound import (
    Allowed,
    OutboundGuard,
    RefusedRequest,
    address_problem,
    guarded_client,
)


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.9.9.9", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("2002:7f00:1::", "loopback"),  # 6to4 around 127.0.0.1
        ("64:ff9b::7f00:1", "loopback"),  # NAT64 around 127.0.0.1
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),
        ("::ffff:192.168.1.1", "private"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("fd12:3456::1", "unique-local"),
        ("fc00::1", "unique-local"),
        # Site-local (fec0::/10, deprecated but routed inside some networks): Python 3.11 counts
        # it neither private nor reserved.
        ("fec0::1", "site-local"),
        ("fec0::a9fe:a9fe", "site-local"),
        ("fed0::1", "site-local"),
        ("feff:ffff::1", "site-local"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "reserved"),
        ("169.254.169.254", "metadata"),
        ("::ffff:169.254.169.254", "metadata"),
        ("fd00:ec2::254", "metadata"),
        ("100.100.100.200", "metadata"),
        ("168.63.129.16", "metadata"),
        ("100.64.0.1", "non-public"),  # carrier-grade NAT, shared
        ("192.0.2.1", "private"),  # documentation
    ],
)
def test_inside_addresses_are_named(address: str, kind: str) -> None:
    problem = address_problem(ipaddress.ip_address(address))
    assert problem is not None and kind in problem, (address, problem)


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "2606:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    assert address_problem(ipaddress.ip_address(address)) is None


def test_the_operator_lets_chosen_hosts_through_but_not_metadata_inside_a_range() -> None:
    allowed = Allowed.parse(" hooks.internal. ,10.0.0.0/8, 127.0.0.2, [::1], 169.254.0.0/16")
    assert allowed.name("HOOKS.internal") and not allowed.name("other.internal")
    for address in ("10.1.2.3", "127.0.0.2", "::1", "::ffff:10.0.0.1", "169.254.1.1"):
        assert allowed.address(ipaddress.ip_address(address)), address
    for address in ("127.0.0.1", "192.168.0.1", "169.254.169.254"):
        assert not allowed.address(ipaddress.ip_address(address)), address
    assert Allowed.parse("169.254.169.254").address(ipaddress.ip_address("169.254.169.254"))
    assert Allowed.parse("") == Allowed()
    with pytest.raises(ValueError, match="no host name"):
        Allowed.parse("http://x/")


class Answers:
    """A resolver that answers from a script, one answer per lookup, and counts them."""

    def __init__(self, *answers: list[str]) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


async def test_a_name_is_refused_if_any_address_it_resolves_to_is_inside() -> None:
    guard = OutboundGuard(resolve=Answers(["93.184.216.34", "10.0.0.7"]))
    problem = await guard.check("https://hooks.example.com/x")
    assert problem is not None and "private" in problem
    assert "10.0.0.7" not in problem  # the kind, not the inside address

    async def nothing(host: str, port: int) -> list[str]:
        raise OSError("Name or service not known")

    problem = await OutboundGuard(resolve=nothing).check("https://nowhere.example/x")
    assert problem is not None and "does not resolve" in problem


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    server = Receiver("127.0.0.2")
    await server.start()
    yield server
    await server.close()


async def test_the_connection_goes_to_the_address_checked_not_a_second_lookup(
    receiver: Receiver,
) -> None:
    """DNS rebinding: the name resolves to an allowed address once, to loopback after. The
    request goes to the address checked, with the name as its Host, and the name is looked up
    once."""
    answers = Answers(["127.0.0.2"], ["127.0.0.1"])
    guard = OutboundGuard(Allowed.parse("127.0.0.2"), resolve=answers)
    url = f"http://rebind.example:{receiver.port}/hook"
    async with guarded_client(guard) as client:
        response = await client.post(url, content=b"{}")
        assert response.status_code == 200
        assert answers.asked == ["rebind.example"]
        [received] = receiver.at("/hook")
        assert received.headers["host"] == f"rebind.example:{receiver.port}"
        # The next lookup says loopback: refused before connecting, not sent.
        with pytest.raises(RefusedRequest, match="loopback"):
            await client.post(url, content=b"{}")
    assert len(receiver.at("/hook")) == 1


async def test_a_redirect_is_not_followed(receiver: Receiver) -> None:
    receiver.answer("/moved", 302)
    guard = OutboundGuard(Allowed.parse("127.0.0.2"))
    async with guarded_client(guard) as client:
        response = await client.post(receiver.url("/moved"), content=b"{}")
    assert response.status_code == 302
    assert [r.path for r in receiver.requests] == ["/moved"]


async def test_a_literal_inside_address_is_refused_before_connecting() -> None:
    async with guarded_client(OutboundGuard()) as client:
        with pytest.raises(RefusedRequest, match="metadata"):
            await client.post("http://169.254.169.254/latest/meta-data/", content=b"")
        with pytest.raises(RefusedRequest, match="loopback"):
            await client.post("http://[::ffff:7f00:1]:9/", content=b"")


async def test_tls_is_checked_against_the_name_though_the_address_is_pinned(
    tmp_path: Path,
) -> None:
    """The server's certificate names localhost and 127.0.0.1. Pinned to 127.0.0.1, a request
    for ``localhost`` passes; one for a name the certificate does not carry fails, though the
    address it connects to is in the certificate: TLS names the host, not the address."""
    certificates = Certificates.make(tmp_path)
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(certificates.server_cert, certificates.server_key)
    names: list[str | None] = []  # the SNI each handshake named
    served.sni_callback = lambda _ssl, name, _context: names.append(name)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readline() not in (b"\r\n", b""):
            pass  # the request's head; no body is sent
        writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=served)
    port = server.sockets[0].getsockname()[1]
    trusted = ssl.create_default_context(cafile=str(certificates.ca))
    guard = OutboundGuard(Allowed.parse("127.0.0.1"), resolve=Answers(["127.0.0.1"]))
    try:
        async with guarded_client(guard, verify=trusted) as client:
            response = await client.post(f"https://localhost:{port}/", content=b"")
            assert response.status_code == 204
            with pytest.raises(httpx.ConnectError, match="certificate"):
                await client.post(f"https://not-in-the-certificate.test:{port}/", content=b"")
    finally:
        server.close()
        await server.wait_closed()
    assert names == ["localhost", "not-in-the-certificate.test"]
