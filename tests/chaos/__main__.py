"""``make chaos``: the full run, restarting the RabbitMQ and FerretDB ``make services`` started.

``--tools`` runs the tools scenario instead (tests/chaos/tools.py): agents calling MCP servers
(stdio and HTTP), a worker and gated tools, while processor replicas and the worker are killed
and RabbitMQ restarts; ``--broker-restarts 0`` leaves the broker alone. ``--own-broker`` starts a
RabbitMQ node of the run's own (tests/support/rabbit_node.py) and restarts that one instead: the
shared servers are then left alone unless the plan stops the store (the echo scenario does).

Exit status: 0 when nothing was lost, duplicated or reordered (nor, with tools, ended twice or
run twice) and the mesh ended healthy; 1 when chaos found a problem; 2 when the servers are not
ours to restart (found running, env URLs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time
from dataclasses import replace

from tests.chaos.faults import (
    LOCAL,
    Faults,
    NotOurServers,
    check_local_servers,
    local_server_faults,
    own_node_faults,
)
from tests.chaos.harness import TOOLS, Plan, Servers, run_chaos
from tests.support.rabbit_node import RabbitNode

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
MONGODB_URL = "mongodb://127.0.0.1:27017/"
MANAGEMENT_URL = "http://127.0.0.1:15672"


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="make chaos", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--tools", action="store_true", help="the tools scenario")
    parser.add_argument("--forums", type=int)
    parser.add_argument("--line-interval", type=float)
    parser.add_argument("--kills-per-service", type=int)
    parser.add_argument("--processor-replicas", type=int)
    parser.add_argument("--broker-restarts", type=int)
    parser.add_argument("--outage-seconds", type=float)
    parser.add_argument("--broker-down-seconds", type=float, default=5.0)
    parser.add_argument("--own-broker", action="store_true", help="restart a node of the run's")
    parser.add_argument("--keep", action="store_true", help="keep the vhost and the database")
    args = parser.parse_args()
    defaults = TOOLS if args.tools else Plan()
    given = {
        "forums": args.forums,
        "line_interval": args.line_interval,
        "kills_per_service": args.kills_per_service,
        "processor_replicas": args.processor_replicas,
        "broker_restarts": args.broker_restarts,
        "store_outage_seconds": args.outage_seconds,
    }
    plan = replace(defaults, keep=args.keep, **{k: v for k, v in given.items() if v is not None})
    # Only a run that restarts or stops a shared server needs them to be ours.
    if plan.store_outages or (plan.broker_restarts and not args.own_broker):
        try:
            check_local_servers(dict(os.environ))
        except NotOurServers as error:
            print(f"[chaos] {error}", file=sys.stderr)
            return 2
    work_dir = LOCAL / "chaos" / time.strftime("%Y%m%d-%H%M%S")
    work_dir.mkdir(parents=True, exist_ok=True)
    # The harness's own clients lose their connections on purpose: their complaints go to a
    # file, not between the report's lines.
    logging.basicConfig(filename=work_dir / "harness.log", level=logging.WARNING)
    with contextlib.ExitStack() as stack:
        servers = Servers(AMQP_URL, MONGODB_URL, MANAGEMENT_URL)
        faults = local_server_faults(args.broker_down_seconds)
        if args.own_broker:
            node = stack.enter_context(RabbitNode.temporary())
            servers = Servers(node.amqp_url, MONGODB_URL, node.management_url)
            own = own_node_faults(node, args.broker_down_seconds)
            faults = Faults(own.broker_label, own.broker, faults.freeze_store, faults.stop_store)
        print(f"[chaos] {plan.scenario}: {plan.forums} forums; logs in {work_dir}", flush=True)
        report = asyncio.run(run_chaos(plan, servers, work_dir, lambda _vhost: faults))
    print(report.render(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
