"""A tool worker written against the documented contract only: pika, and no yoke at all.

What a user in another language would write (docs/tools.md, "Tool workers"), run as its
own process::

    python -m tests.support.pika_worker --url AMQP_URL --tool NAME --mode MODE

``AMQP_URL`` names the tool's user (``tool-NAME``) and the mesh's vhost. It prints one JSON
line per thing a test may wait for, flushed at once, each with an ``event``:

- ``{"event": "ready"}`` once it consumes its queue (not in ``as-other`` and ``probe``);
- ``{"event": "call", "callId", "redelivered", "call"}`` for each call it takes, ``call``
  being the body as it came;
- ``{"event": "reply", "callId", "reply"}`` for each reply of the door, ``reply`` being the
  door's JSON as it came (``{"status", "duplicate"?, "code"?, "error"?}``);
- ``{"event": "probe", "attempt", "refused", "error"?}`` for each attempt of ``probe``.

Modes:

- ``answer``: answers each call with ``output`` = JSON ``{"input": <the call's input>,
  "marker": MARKER}`` (or, with ``--output-bytes N``, N bytes of ``x``: an answer too large);
- ``twice``: answers each call so twice, and prints both replies;
- ``never``: takes and acks each call but never answers it;
- ``hold``: answers the calls it holds once the file ``--release FILE`` exists;
- ``error``: answers each call with ``isError`` true and the output ``failed: MARKER``;
- ``as-other``: consumes nothing; answers ``--target-call CALLID`` once, prints the reply and
  exits (the call of another tool, an unknown or a closed call);
- ``no-user-id``: as ``answer``, but publishes without the AMQP ``user_id`` (or, with
  ``--target-call``, answers that call so once and exits);
- ``probe``: tries what its user must not do (and, as a control, consuming its own queue),
  one attempt per channel (a refusal closes the channel), and exits.

A call is acked only after the door's reply to its answer (so a worker killed mid-call leaves
it to be delivered again); SIGTERM stops it between calls.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]

COMMANDS = "yoke.commands"
RESULT_KEY = "tool.result.submit"
DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"
REPLY_TIMEOUT = 30.0


def emit(**line: Any) -> None:
    print(json.dumps(line), flush=True)


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.user = unquote(urlsplit(args.url).username or "guest")
        self.connection = pika.BlockingConnection(pika.URLParameters(args.url))
        self.channel = self.connection.channel()
        self.channel.confirm_delivery()
        # Direct reply-to: consumed without acks on the channel that publishes the answers.
        self.channel.basic_consume(DIRECT_REPLY_TO, self.on_reply, auto_ack=True)
        self.replies: dict[str, dict[str, Any]] = {}
        # Calls taken off the queue, answered from the main loop (pika's blocking connection
        # must not be driven from inside one of its own callbacks).
        self.calls: list[tuple[int, dict[str, Any]]] = []
        self.stopping = False

    def on_reply(self, _channel: Any, _method: Any, properties: Any, body: bytes) -> None:
        self.replies[properties.correlation_id or ""] = json.loads(body)

    def on_call(self, _channel: Any, method: Any, _properties: Any, body: bytes) -> None:
        call = json.loads(body)
        emit(event="call", callId=call.get("callId"), redelivered=method.redelivered, call=call)
        self.calls.append((method.delivery_tag, call))

    def answer(self, call_id: str, output: str, *, is_error: bool = False) -> dict[str, Any]:
        """Publish the answer, wait for the door's reply, print it and return it."""
        correlation_id = uuid.uuid4().hex
        body: dict[str, Any] = {"callId": call_id, "output": output}
        if is_error:
            body["isError"] = True
        properties = pika.BasicProperties(
            content_type="application/json",
            delivery_mode=2,
            correlation_id=correlation_id,
            message_id=correlation_id,
            reply_to=DIRECT_REPLY_TO,
            user_id=None if self.args.mode == "no-user-id" else self.user,
        )
        self.channel.basic_publish(COMMANDS, RESULT_KEY, json.dumps(body).encode(), properties)
        deadline = time.monotonic() + REPLY_TIMEOUT
        while correlation_id not in self.replies:
            if time.monotonic() > deadline:
                raise SystemExit(f"no reply from the door within {REPLY_TIMEOUT} s for {call_id}")
            self.connection.process_data_events(time_limit=0.1)
        reply = self.replies.pop(correlation_id)
        emit(event="reply", callId=call_id, reply=reply)
        return reply

    def output_for(self, call: dict[str, Any]) -> str:
        if self.args.output_bytes is not None:
            return "x" * self.args.output_bytes
        return json.dumps({"input": call.get("input"), "marker": self.args.marker})

    def handle(self, tag: int, call: dict[str, Any]) -> None:
        mode, call_id = self.args.mode, str(call.get("callId"))
        if mode in ("answer", "no-user-id", "hold"):
            self.answer(call_id, self.output_for(call))
        elif mode == "twice":
            self.answer(call_id, self.output_for(call))
            self.answer(call_id, self.output_for(call))
        elif mode == "error":
            self.answer(call_id, f"failed: {self.args.marker}", is_error=True)
        self.channel.basic_ack(tag)

    def serve(self) -> None:
        self.channel.basic_qos(prefetch_count=self.args.prefetch)
        self.channel.basic_consume(f"yoke.tool.{self.args.tool}", self.on_call)
        emit(event="ready")
        release = Path(self.args.release) if self.args.release else None
        while not self.stopping:
            self.connection.process_data_events(time_limit=0.1)
            if self.args.mode == "hold" and (release is None or not release.exists()):
                continue
            while self.calls:
                self.handle(*self.calls.pop(0))
        self.connection.close()

    def answer_target(self) -> None:
        output = json.dumps({"marker": self.args.marker})
        self.answer(self.args.target_call, output)
        self.connection.close()


def probe(args: argparse.Namespace) -> None:
    """Each attempt on a fresh channel; prints whether the broker refused it."""
    user = unquote(urlsplit(args.url).username or "guest")
    connection = pika.BlockingConnection(pika.URLParameters(args.url))
    own = f"yoke.tool.{args.tool}"

    def consume(queue: str) -> Any:
        return lambda channel: channel.basic_consume(queue, lambda *_: None)

    def bind(queue: str, exchange: str) -> Any:
        return lambda channel: channel.queue_bind(queue, exchange, routing_key="#")

    def publish(exchange: str, key: str, user_id: str | None) -> Any:
        def attempt(channel: Any) -> None:
            channel.confirm_delivery()
            properties = pika.BasicProperties(user_id=user_id)
            channel.basic_publish(exchange, key, b"{}", properties, mandatory=False)

        return attempt

    attempts = [
        (f"consume {own}", consume(own)),
        (f"consume {args.other_queue}", consume(args.other_queue)),
        (f"bind {own} to yoke.events", bind(own, "yoke.events")),
        (f"bind {own} to yoke.forum", bind(own, "yoke.forum")),
        (f"bind {args.other_queue} to yoke.events", bind(args.other_queue, "yoke.events")),
        ("declare queue worker.own", lambda channel: channel.queue_declare("worker.own")),
        ("declare a server-named queue", lambda channel: channel.queue_declare("", exclusive=True)),
        (f"declare {own}", lambda channel: channel.queue_declare(own, durable=True)),
        ("publish to yoke.events", publish("yoke.events", "conversation.message.posted.x", user)),
        (f"publish to {own}", publish("", own, user)),
        ("publish as another user", publish(COMMANDS, RESULT_KEY, "guest")),
    ]
    for name, attempt in attempts:
        channel = connection.channel()
        try:
            attempt(channel)
            connection.process_data_events(time_limit=0.2)  # a late channel.close comes here
            if not channel.is_open:
                raise pika.exceptions.ChannelClosed(0, "closed after the attempt")
            emit(event="probe", attempt=name, refused=False)
            channel.close()
        except pika.exceptions.AMQPChannelError as error:
            emit(event="probe", attempt=name, refused=True, error=repr(error))
    connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="AMQP URL as the tool's user")
    parser.add_argument("--tool", required=True)
    parser.add_argument(
        "--mode",
        required=True,
        choices=["answer", "twice", "never", "hold", "error", "as-other", "no-user-id", "probe"],
    )
    parser.add_argument("--marker", default="pika-worker", help="put in every output")
    parser.add_argument("--release", help="hold: answer once this file exists")
    parser.add_argument("--target-call", help="as-other (and no-user-id): the call to answer")
    parser.add_argument("--other-queue", default="yoke.dead-letters", help="probe: not ours")
    parser.add_argument("--prefetch", type=int, default=8)
    parser.add_argument("--output-bytes", type=int, help="answer with this many bytes of x")
    args = parser.parse_args()
    if args.mode == "hold" and not args.release:
        parser.error("--mode hold needs --release FILE")
    if args.mode == "as-other" and not args.target_call:
        parser.error("--mode as-other needs --target-call CALLID")
    if args.mode == "probe":
        probe(args)
        return
    worker = Worker(args)
    if args.target_call:
        worker.answer_target()
        return

    def stop(*_: object) -> None:
        worker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.serve()


if __name__ == "__main__":
    main()
