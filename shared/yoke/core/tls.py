"""TLS to RabbitMQ and MongoDB: the connection options built from the settings, and a
certificate that does not verify reported as a misconfiguration.

An ``amqps://`` URL is connected with an SSL context built from ``YOKE_AMQP_CA_FILE`` (and
``YOKE_AMQP_CERT_FILE`` / ``YOKE_AMQP_KEY_FILE`` when the broker asks for a client
certificate); without them aiormq's own URL parameters (``?cafile=...``) or the system's CAs
apply. A MongoDB URL takes pymongo's ``tls=true&tlsCAFile=...``, or ``YOKE_MONGODB_CA_FILE`` /
``YOKE_MONGODB_CERT_FILE`` on top of it. Verification is never turned off here.

A server whose certificate does not verify will not start to verify by waiting: treated as an
unreachable server (transient, retried for as long as it lasts) it would be a reconnect loop
nobody notices, so :func:`refused_as_misconfigured` turns it into :class:`Misconfigured` (a
service exits 78 and ``yoke up`` leaves it down; the CLI says why and exits 78).
"""

from __future__ import annotations

import contextlib
import re
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypedDict

from aiormq.exceptions import AMQPError
from pymongo.errors import PyMongoError

from yoke.core.errors import Misconfigured
from yoke.core.settings import Settings

# OpenSSL's words for "the certificate did not verify", on our side or on the server's.
_VERIFY_FAILED = re.compile(r"certificate verify failed: (?P<reason>[^()\n]*?)\.? \(_ssl\.c:\d+\)")
_PEER_REFUSED = re.compile(r"ALERT_(UNKNOWN_CA|BAD_CERTIFICATE|CERTIFICATE_REQUIRED)")


class AmqpOptions(TypedDict, total=False):
    """What :func:`amqp_options` adds to aio-pika's connect call (typed, so mypy checks it)."""

    ssl_context: ssl.SSLContext


def is_amqps(url: str) -> bool:
    """True when ``url`` (or any node of a comma-separated list) is ``amqps://``."""
    return any(part.strip().lower().startswith("amqps://") for part in url.split(","))


def amqp_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """A verifying client context from the settings' files, or None when none is set."""
    ca, cert, key = settings.amqp_ca_file, settings.amqp_cert_file, settings.amqp_key_file
    if not (ca or cert or key):
        return None
    if key and not cert:
        raise Misconfigured("YOKE_AMQP_KEY_FILE is set without YOKE_AMQP_CERT_FILE")
    for path, setting in ((ca, "YOKE_AMQP_CA_FILE"), (cert, "YOKE_AMQP_CERT_FILE"),
                          (key, "YOKE_AMQP_KEY_FILE")):  # fmt: skip
        if path:
            readable(path, setting)
    try:
        context = ssl.create_default_context(cafile=ca)
    except ssl.SSLError as error:
        problem = f"YOKE_AMQP_CA_FILE {ca}: not a PEM CA certificate ({error})"
        raise Misconfigured(problem) from error
    if cert:
        try:
            context.load_cert_chain(cert, key)
        except ssl.SSLError as error:
            raise Misconfigured(
                f"YOKE_AMQP_CERT_FILE {cert} / YOKE_AMQP_KEY_FILE {key}: not a certificate "
                f"and its key ({error})"
            ) from error
    return context


def amqp_options(url: str, settings: Settings | None = None) -> AmqpOptions:
    """Keyword arguments for ``aio_pika.connect``/``connect_robust`` to ``url``.

    Every AMQP connection of the mesh goes through here, so ``amqps://`` works the same for
    the services, the CLI and the client (settings read from the environment by default).
    """
    if not is_amqps(url):
        return {}
    context = amqp_ssl_context(settings or Settings())
    return AmqpOptions() if context is None else AmqpOptions(ssl_context=context)


def mongodb_options(settings: Settings | None = None) -> dict[str, Any]:
    """Keyword arguments for pymongo's client: the settings' CA and client-certificate files
    (each implies ``tls=true``; a URL with ``tls=false`` and one of them is refused by pymongo)."""
    settings = settings or Settings()
    options: dict[str, Any] = {}
    if settings.mongodb_ca_file:
        options["tlsCAFile"] = readable(settings.mongodb_ca_file, "YOKE_MONGODB_CA_FILE")
    if settings.mongodb_cert_file:
        options["tlsCertificateKeyFile"] = readable(
            settings.mongodb_cert_file, "YOKE_MONGODB_CERT_FILE"
        )
    return options


def readable(path: str, setting: str) -> str:
    """``path``, or :class:`Misconfigured` naming ``setting`` when it cannot be read."""
    try:
        with open(path, "rb"):
            return path
    except OSError as error:
        raise Misconfigured(f"{setting} {path}: {error.strerror or error}") from error


@dataclass(frozen=True)
class Refusal:
    """A TLS certificate refusal: ``server`` (RabbitMQ, MongoDB) and which side refused."""

    server: str
    ours_refused: bool  # the server refused this client's certificate (else we refused its)
    detail: str

    def __str__(self) -> str:
        if self.ours_refused:
            return (
                f"{self.server} did not accept this client's TLS certificate ({self.detail}): "
                f"{_CLIENT_HINTS.get(self.server, 'check the client certificate settings')}"
            )
        return (
            f"TLS verification of {self.server}'s certificate failed ({self.detail}): "
            f"{_CA_HINTS.get(self.server, 'the CA file must name the CA that signed it')}"
        )


_CA_HINTS = {
    "RabbitMQ": "YOKE_AMQP_CA_FILE (or ?cafile= in the URL) must name the CA that signed it, "
    "for the host in the URL",
    "MongoDB": "YOKE_MONGODB_CA_FILE (or tlsCAFile in the URL) must name the CA that signed "
    "it, for the host in the URL",
}
_CLIENT_HINTS = {
    "RabbitMQ": "YOKE_AMQP_CERT_FILE / YOKE_AMQP_KEY_FILE must name a certificate its CA "
    "signed and that certificate's key",
    "MongoDB": "YOKE_MONGODB_CERT_FILE must name a certificate its CA signed, with its key",
}


def verification_failure(error: BaseException) -> Refusal | None:
    """The TLS certificate refusal behind ``error`` (or what caused it), else None."""
    server = "the server"
    seen: set[int] = set()
    current: BaseException | None = error
    found: tuple[bool, str] | None = None
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PyMongoError):
            server = "MongoDB"
        elif isinstance(current, AMQPError) and server == "the server":
            server = "RabbitMQ"
        if found is None:
            found = _refusal_in(current)
        current = current.__cause__ or current.__context__
    return None if found is None else Refusal(server, *found)


def _refusal_in(error: BaseException) -> tuple[bool, str] | None:
    if isinstance(error, ssl.SSLCertVerificationError):
        return False, error.verify_message or str(error)
    # pymongo reports it inside a ServerSelectionTimeoutError's text, server by server.
    text = str(error)
    match = _VERIFY_FAILED.search(text)
    if match:
        return False, match.group("reason").strip().rstrip(".") or "certificate verify failed"
    peer = _PEER_REFUSED.search(text)
    if peer:
        return True, peer.group(0).lower().replace("_", " ")
    return None


@contextlib.contextmanager
def refused_as_misconfigured() -> Iterator[None]:
    """Raise :class:`Misconfigured` naming the server and the setting to fix for a TLS
    certificate refusal escaping the block; every other error passes through unchanged."""
    try:
        yield
    except Misconfigured:
        raise
    except Exception as error:
        refusal = verification_failure(error)
        if refusal is None:
            raise
        raise Misconfigured(str(refusal)) from error
