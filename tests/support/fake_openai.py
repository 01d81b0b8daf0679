"""An OpenAI-compatible HTTP server for tests: real HTTP, scripted answers, recorded requests.

Like OpenAI it refuses a prompt that breaks the message-order rules
(:mod:`tests.support.chat_rules`) with a 400, without using up a scripted reply; refused
requests are kept in ``rejected``.
"""

from __future__ import annotations

import json
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


class FakeOpenAI:
    """Serves scripted replies in order; when none are queued, ``default`` answers."""

    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.default: Reply | None = None
        self.requests: list[dict[str, Any]] = []
        self.rejected: list[tuple[dict[str, Any], Violation]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
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
                payload = json.dumps(reply.body).encode()
                self.send_response(reply.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

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
