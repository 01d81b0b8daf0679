"""An OpenAI-compatible HTTP server for tests: real HTTP, scripted answers, recorded requests.

Like OpenAI it refuses a prompt that breaks the message-order rules
(:mod:`tests.support.chat_rules`) with a 400, without using up a scripted reply; refused
requests are kept in ``rejected``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.chat_rules import Violation, first_violation


@dataclass
class Reply:
    status: int = 200
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    # Streamed (the request asked ``stream``): the text in this many pieces, this far apart,
    # and the connection dropped after ``break_after`` pieces (None: the whole answer).
    pieces: int = 1
    piece_delay: float = 0.0
    break_after: int | None = None


def streamed(
    reply: Reply, *, pieces: int, piece_delay: float = 0.0, break_after: int | None = None
) -> Reply:
    """``reply`` (a completion) served as a stream of ``pieces`` text pieces."""
    reply.pieces, reply.piece_delay, reply.break_after = pieces, piece_delay, break_after
    return reply


def stream_chunks(reply: Reply) -> list[dict[str, Any]]:
    """The chat.completion.chunk objects of a completion, as OpenAI streams it."""
    body = reply.body
    message = body["choices"][0]["message"]
    base = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    text = message.get("content") or ""
    if text:
        size = max(1, -(-len(text) // reply.pieces))
        chunks += [chunk({"content": text[i : i + size]}) for i in range(0, len(text), size)]
    for index, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": index, **call}]}))
    chunks.append(chunk({}, body["choices"][0]["finish_reason"]))
    chunks.append(base | {"choices": [], "usage": body["usage"]})
    return chunks


def completion(
    text: str | None = None,
    tool_calls: list[tuple[str, str, str]] | None = None,
    *,
    prompt_tokens: int = 11,
    completion_tokens: int = 7,
    model: str = "gpt-test",
) -> Reply:
    """A chat.completion; ``tool_calls`` are (id, name, raw JSON arguments)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for call_id, name, arguments in tool_calls
        ]
    return Reply(
        body={
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if tool_calls else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
    )


def openai_env(
    base_url: str, *, api_key: str = "sk-test-not-a-secret", give_up_seconds: int = 2, **more: str
) -> dict[str, str]:
    """The services' settings for an OpenAI-compatible server at ``base_url``.

    The provider gives up after ``give_up_seconds`` (one request's timeout too), so that a
    failing server is seen within a test's waits.
    """
    return {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": api_key,
        "YOKE_PROVIDER_GIVE_UP_SECONDS": str(give_up_seconds),
        "YOKE_PROVIDER_REQUEST_TIMEOUT_SECONDS": str(give_up_seconds),
        **more,
    }


def failure(status: int, headers: dict[str, str] | None = None) -> Reply:
    return Reply(
        status=status,
        body={"error": {"message": f"scripted {status}", "type": "test"}},
        headers=headers or {},
    )


def embedding(text: str, dimensions: int = 8) -> list[float]:
    """The vector the server answers for ``text`` unless scripted: a pure function of the text."""
    digest = hashlib.sha256(text.encode()).digest()
    return [(digest[i % len(digest)] - 127.5) / 127.5 for i in range(dimensions)]


def embeddings(vectors: list[list[float]], *, model: str = "embed-test") -> Reply:
    """An embeddings answer carrying exactly ``vectors`` (a test's oversize or ragged ones)."""
    data = [
        {"object": "embedding", "index": index, "embedding": vector}
        for index, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": len(vectors), "total_tokens": len(vectors)}
    return Reply(body={"object": "list", "data": data, "model": model, "usage": usage})


class FakeOpenAI:
    """Serves scripted replies in order; when none are queued, ``default`` answers.

    ``/v1/embeddings`` has its own queue (``embedding_replies``) and record
    (``embedding_requests``); unscripted, it answers :func:`embedding` of each input.
    """

    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.default: Reply | None = None
        self.requests: list[dict[str, Any]] = []
        self.rejected: list[tuple[dict[str, Any], Violation]] = []
        self.embedding_replies: deque[Reply] = deque()
        self.embedding_requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked streams, kept-alive connections

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path.rstrip("/").endswith("/embeddings"):
                    self.answer(self.embeddings_reply(body))
                    return
                violation = first_violation(body.get("messages") or [])
                reply: Reply | None
                with fake._lock:
                    fake.requests.append(body)
                    if violation is not None:
                        fake.rejected.append((body, violation))
                        reply = Reply(status=400, body=violation.error_body())
                    else:
                        reply = fake.replies.popleft() if fake.replies else fake.default
                if reply is None:
                    reply = completion(f"echo: {body['messages'][-1].get('content')}")
                if body.get("stream") and reply.status == 200:
                    self.stream(reply)
                    return
                self.answer(reply)

            def embeddings_reply(self, body: dict[str, Any]) -> Reply:
                with fake._lock:
                    fake.embedding_requests.append(body)
                    scripted = fake.embedding_replies.popleft() if fake.embedding_replies else None
                given = body.get("input") or []
                texts: list[str] = [given] if isinstance(given, str) else given
                reply = scripted or embeddings(
                    [embedding(text, body.get("dimensions") or 8) for text in texts]
                )
                if body.get("encoding_format") == "base64" and reply.status == 200:
                    for item in reply.body["data"]:
                        packed = struct.pack(f"<{len(item['embedding'])}f", *item["embedding"])
                        item["embedding"] = base64.b64encode(packed).decode()
                return reply

            def answer(self, reply: Reply) -> None:
                payload = json.dumps(reply.body).encode()
                self.send_response(reply.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

            def stream(self, reply: Reply) -> None:
                """Server-sent events, chunked: a dropped stream is a truncated body."""
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                pieces = 0
                for chunk in stream_chunks(reply):
                    choices = chunk["choices"]
                    if choices and choices[0]["delta"].get("content"):
                        if reply.break_after is not None and pieces >= reply.break_after:
                            self.close_connection = True  # the body ends short: a broken stream
                            return
                        pieces += 1
                        time.sleep(reply.piece_delay)
                    self.write_chunk(f"data: {json.dumps(chunk)}\n\n".encode())
                self.write_chunk(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def write_chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def script(self, *replies: Reply) -> None:
        with self._lock:
            self.replies.clear()
            self.replies.extend(replies)
            self.requests.clear()
            self.rejected.clear()

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()
