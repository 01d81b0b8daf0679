"""A request's body, read within the gateway's bounds (invariant 14): refused past a size
before it is all read (413), and when it does not arrive within the header timeout (408: a
slow body holds a connection as a slow head would). A client that goes before its body has all
come is one line, counted (``client_disconnect``), not an error: there is no one to answer. The
REST API, the MCP and the A2A doors all read their bodies here, and the REST routes parse them
here (:func:`json_request`), as strictly as the AMQP door, with their Idempotency-Key."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request

from services.gateway.deps import ApiError, gateway
from services.gateway.limits import REFUSALS
from yoke.core.errors import describe_validation_error
from yoke.core.json_limits import MAX_BODY_DEPTH, nesting_depth
from yoke.core.models import WireModel, unstorable

log = logging.getLogger(__name__)

# A Content-Length as ASCII digits, few enough for int() to read at once (int() takes other
# scripts' digits, and refuses more than 4,300 of them).
LENGTH_PATTERN = re.compile(r"[0-9]{1,18}")
MAX_IDEMPOTENCY_KEY_CHARS = 128
# An Idempotency-Key is visible ASCII and spaces: header bytes past ASCII mean different
# characters to different clients.
IDEMPOTENCY_KEY_PATTERN = re.compile(r"[\x20-\x7e]+")
BodyModel = TypeVar("BodyModel", bound=WireModel)


async def read_body(request: Request, limit: int, seconds: float) -> bytes:
    """The body of ``request``: at most ``limit`` bytes, all within ``seconds``."""
    declared = request.headers.get("content-length")
    if declared is not None and (not LENGTH_PATTERN.fullmatch(declared) or int(declared) > limit):
        raise ApiError(413, "too_large", f"body is {declared[:20]} bytes; the limit is {limit}")
    body = bytearray()
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise ApiError(413, "too_large", f"body is over the limit of {limit} bytes")
    except TimeoutError as error:
        REFUSALS.labels("body_timeout").inc()
        raise ApiError(
            408, "body_timeout", f"the body did not arrive within {seconds:g} s"
        ) from error
    except ClientDisconnect as error:
        raise client_gone(request, len(body)) from error
    return bytes(body)


def client_gone(request: Request, received: int | None = None) -> ApiError:
    """The client closed its connection before its body had all come: one line, counted, and
    an answer (400) that goes nowhere (the server drops what is sent to a closed connection)."""
    REFUSALS.labels("client_disconnect").inc()
    got = "" if received is None else f" ({received} bytes received)"
    log.info(
        "client went before its body had all come: %s %s%s", request.method, request.url.path, got
    )
    return ApiError(400, "client_disconnect", "the client went before its body had all come")


def json_body(model: type[WireModel], *, required: bool = True) -> dict[str, Any]:
    """A route's required JSON body in the OpenAPI document (routes parse it themselves, with
    :func:`json_request`, to answer bad input as the AMQP door does)."""
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": model.model_json_schema(by_alias=True)}},
        }
    }


async def json_request(
    request: Request, limit: int, model: type[BodyModel], *, optional: bool = False
) -> BodyModel:
    """The request's body as ``model``: read as every door reads one (:func:`read_body`:
    413, 408), then 415 unless it is ``application/json``, then :func:`parse_body`'s 400s.
    ``optional``: no body at all is ``{}`` (a route whose every field has a default)."""
    timeout = gateway(request).settings.gateway_header_timeout_seconds
    body = await read_body(request, limit, timeout)
    if optional and not body:
        return parse_body(b"{}", model)
    media_type, _, parameters = request.headers.get("content-type", "").partition(";")
    charset = parameters.strip().lower().removeprefix("charset=").strip('"')
    if media_type.strip().lower() != "application/json" or charset not in ("", "utf-8"):
        raise ApiError(
            415, "unsupported_media_type", "the body must be JSON: Content-Type application/json"
        )
    return parse_body(body, model)


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text[:20]} is out of a number's range")
    return number


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError(f"key {key[:40]!r} appears twice")
        found[key] = value
    return found


def parse_body(body: bytes, model: type[BodyModel]) -> BodyModel:
    """A JSON object body as ``model``, or a 400 naming what is wrong with it: as strict as the
    AMQP door (UTF-8, depth, no NaN or Infinity), and stricter where JSON is ambiguous (a key
    twice, a number past a float's range)."""
    try:
        text = body.decode()
    except UnicodeDecodeError as error:
        raise ApiError(
            400, "invalid_body", f"body is not valid UTF-8 ({error.reason} at byte {error.start})"
        ) from error
    if nesting_depth(body) > MAX_BODY_DEPTH:
        raise ApiError(
            400, "invalid_body", f"body is nested too deeply (more than {MAX_BODY_DEPTH} levels)"
        )
    try:
        data = json.loads(
            text,
            parse_constant=_no_constants,
            parse_float=_finite,
            object_pairs_hook=_unique_keys,
        )
    except ValueError as error:
        raise ApiError(400, "invalid_body", f"body is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_body", "body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ApiError(400, "invalid_body", describe_validation_error(error)) from error


def check_idempotency_key(request: Request, idempotency_key: str | None) -> None:
    """One key of 1-128 visible ASCII characters (or none): two keys, or bytes past ASCII,
    would mean different lines to different readers of the same request."""
    if len(request.headers.getlist("idempotency-key")) > 1:
        raise ApiError(400, "invalid_idempotency_key", "send one Idempotency-Key, not several")
    if idempotency_key is not None and (
        not 0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY_CHARS
        or not IDEMPOTENCY_KEY_PATTERN.fullmatch(idempotency_key)
        or unstorable(idempotency_key)
    ):
        raise ApiError(
            400,
            "invalid_idempotency_key",
            f"Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY_CHARS} characters of visible ASCII",
        )
