"""May the mesh call this URL on an outsider's word?

A URL someone outside the deployment gives the mesh to call (an A2A task's push notification
URL, set by a token) must not reach into the operator's network: the gateway would POST from
inside it, signed, with a body the caller steers, and retry. So such a URL is refused when its
host resolves to a loopback, private, link-local, unique-local, site-local, multicast,
unspecified, reserved or otherwise non-public address, or a cloud metadata address (IPv4, IPv6,
and IPv4 inside IPv6: mapped, 6to4, Teredo, NAT64), unless the operator lets that host through
(``YOKE_PUSH_ALLOWED_HOSTS``: host names, IPs or CIDRs, comma-separated).

It is checked twice: when the URL is set (every address the host resolves to must pass; a host
that does not resolve is refused) and when the mesh connects (:class:`GuardedTransport`
resolves once, checks, and connects to the address it checked, keeping the name for the Host
header and TLS, so a name that resolves elsewhere by then, DNS rebinding, changes nothing).
Redirects are not followed. URLs an operator sets (``yoke webhook add``) are the operator's
word and are not checked here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# A host's addresses (the resolver is replaceable: tests, or a deployment's own).
Resolver = Callable[[str, int], Awaitable[list[str]]]

# Cloud metadata services (AWS, its ECS task endpoint and IPv6 one, GCP and Azure at the
# first, Alibaba, Azure's WireServer): refused even when a CIDR the operator allows covers them;
# only the exact address listed lets one through.
METADATA = frozenset(
    ipaddress.ip_address(address)
    for address in (
        "169.254.169.254",
        "169.254.170.2",
        "fd00:ec2::254",
        "100.100.100.200",
        "168.63.129.16",
    )
)
NAT64 = ipaddress.ip_network("64:ff9b::/96")
UNIQUE_LOCAL = ipaddress.ip_network("fc00::/7")
RESOLVE_SECONDS = 5.0
WHY = (
    "the mesh calls no address inside its own network on a caller's word "
    "(an operator lets a host through with YOKE_PUSH_ALLOWED_HOSTS)"
)
_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")


class Refused(Exception):
    """A URL the mesh will not call on an outsider's word (the message says why)."""


class ForbiddenAddress(Refused):
    """Its host is, or resolves to, an address inside the operator's network."""


class Unresolvable(Refused):
    """Its host resolves to no address (now: DNS may answer later)."""


def _embedded(address: ipaddress.IPv6Address) -> Iterator[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries to a translator or tunnel on the way."""
    if address.ipv4_mapped is not None:
        yield address.ipv4_mapped
    if address.sixtofour is not None:
        yield address.sixtofour
    if address.teredo is not None:
        yield from address.teredo
    if address in NAT64:
        yield ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)


def address_problem(address: Address) -> str | None:
    """What kind of inside address ``address`` is (None: a public one the mesh may call)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            address = ipaddress.IPv6Address(str(address).split("%", 1)[0])
        for inner in _embedded(address):
            if (problem := address_problem(inner)) is not None:
                return f"{problem} inside an IPv6 one"
    if address in METADATA:
        return "a cloud metadata address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_unspecified:
        return "the unspecified address"
    if address.is_link_local:
        return "a link-local address"
    if isinstance(address, ipaddress.IPv6Address) and address in UNIQUE_LOCAL:
        return "a unique-local address"
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        # fec0::/10: deprecated (RFC 3879) but still routed inside some networks, and neither
        # private nor reserved (so "global") to Python 3.11's ipaddress.
        return "a site-local address"
    if address.is_multicast:
        return "a multicast address"
    if address.is_reserved:
        return "a reserved address"
    if address.is_private:
        return "a private address"
    if not address.is_global:
        return "a non-public address"
    return None


def _host(text: str) -> str:
    return text.strip().lower().rstrip(".")


@dataclass(frozen=True)
class Allowed:
    """The hosts an operator lets through: names (exactly) and IPs or CIDRs."""

    names: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, text: str) -> Allowed:
        """``YOKE_PUSH_ALLOWED_HOSTS``: comma-separated; a bad entry is an error at start."""
        names: set[str] = set()
        networks: list[Network] = []
        for entry in (_host(part) for part in text.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            if not _NAME.fullmatch(entry):
                raise ValueError(
                    f"YOKE_PUSH_ALLOWED_HOSTS: {entry!r} is no host name, IP address or CIDR"
                )
            names.add(entry)
        return cls(frozenset(names), tuple(networks))

    def name(self, host: str) -> bool:
        return _host(host) in self.names

    def address(self, address: Address) -> bool:
        candidates: list[Address] = [address]
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            candidates.append(address.ipv4_mapped)
        for network in self.networks:
            for candidate in candidates:
                if candidate.version != network.version or candidate not in network:
                    continue
                # A metadata address passes only when listed itself, not inside a range.
                if candidate not in METADATA or network.num_addresses == 1:
                    return True
        return False


async def system_resolve(host: str, port: int) -> list[str]:
    """The host's addresses, as the system resolves them."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if address not in found:
            found.append(address)
    return found


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


class OutboundGuard:
    """The check of one process: its operator's allowed hosts and its resolver."""

    def __init__(
        self,
        allowed: Allowed | None = None,
        resolve: Resolver = system_resolve,
        resolve_seconds: float = RESOLVE_SECONDS,
    ) -> None:
        self.allowed = allowed or Allowed()
        self.resolve = resolve
        self.resolve_seconds = resolve_seconds

    def problem(self, address: Address) -> str | None:
        """Why the mesh may not connect to ``address`` (None: it may)."""
        if self.allowed.address(address):
            return None
        return address_problem(address)

    async def address_for(self, url: str) -> str:
        """The one address to connect to for ``url``: its host resolved once, and every
        address it resolves to allowed (else :class:`ForbiddenAddress`; none:
        :class:`Unresolvable`)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        literal = _literal(host)
        if literal is not None:
            if (problem := self.problem(literal)) is not None:
                raise ForbiddenAddress(f"{literal} is {problem}: {WHY}")
            return str(literal)
        try:
            async with asyncio.timeout(self.resolve_seconds):
                found = await self.resolve(host, port)
        except (OSError, TimeoutError, UnicodeError) as error:
            raise Unresolvable(f"its host {host!r} does not resolve") from error
        addresses = [a for a in (_literal(text) for text in found) if a is not None]
        if not addresses:
            raise Unresolvable(f"its host {host!r} does not resolve")
        if not self.allowed.name(host):
            for address in addresses:
                if (problem := self.problem(address)) is not None:
                    # The kind, not the address: a caller learns no inside address from it.
                    raise ForbiddenAddress(f"its host {host!r} resolves to {problem}: {WHY}")
        return str(addresses[0])

    async def check(self, url: str) -> str | None:
        """Why ``url`` may not be called on an outsider's word (None: it may), for a URL
        being set."""
        try:
            await self.address_for(url)
        except Refused as refused:
            return str(refused)
        return None


def guard_for(allowed_hosts: str) -> OutboundGuard:
    return OutboundGuard(Allowed.parse(allowed_hosts))


class RefusedRequest(httpx.TransportError):
    """A request the guard stopped before connecting: an inside address (never retried)."""


class GuardedTransport(httpx.AsyncBaseTransport):
    """httpx's transport, connecting only to an address the guard checked just now.

    The request's URL is rewritten to that address (so nothing resolves the name again), its
    Host header stays the name's and TLS names the host (SNI, and the certificate is checked
    against it). Connections are not kept alive: a pooled one is keyed by address, and could be
    reused for another name on it."""

    def __init__(self, guard: OutboundGuard, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.guard = guard
        self.inner = inner or httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_keepalive_connections=0), trust_env=False
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        try:
            address = await self.guard.address_for(str(request.url))
        except ForbiddenAddress as refused:
            raise RefusedRequest(str(refused), request=request) from None
        except Unresolvable as unresolved:
            raise httpx.ConnectError(str(unresolved), request=request) from None
        if _literal(host) is None:
            request.url = request.url.copy_with(host=address)
            if request.url.scheme == "https":
                request.extensions = {**request.extensions, "sni_hostname": host}
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def guarded_client(
    guard: OutboundGuard, *, verify: ssl.SSLContext | bool = True
) -> httpx.AsyncClient:
    """A client for URLs an outsider gave: checked at connect time, no redirects followed, no
    proxy from the environment (it would resolve the name itself). ``verify``: the CAs a
    receiver's certificate is checked against (the system's by default)."""
    inner = httpx.AsyncHTTPTransport(
        verify=verify, limits=httpx.Limits(max_keepalive_connections=0), trust_env=False
    )
    return httpx.AsyncClient(
        transport=GuardedTransport(guard, inner), follow_redirects=False, trust_env=False
    )
