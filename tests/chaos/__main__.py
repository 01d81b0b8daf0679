"""``make chaos``: the full run, restarting the RabbitMQ and FerretDB ``make services`` started.

Exit status: 0 when nothing was lost, duplicated or reordered and the mesh ended healthy; 1 when
chaos found a problem; 2 when the servers are not ours to restart (found running, env URLs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import replace

from tests.chaos.faults import LOCAL, NotOurServers, check_local_servers, local_server_faults
from tests.chaos.harness import Plan, Servers, run_chaos

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
MONGODB_URL = "mongodb://127.0.0.1:27017/"
MANAGEMENT_URL = "http://127.0.0.1:15672"


def main() -> int:
    defaults = Plan()
    parser = argparse.ArgumentParser(prog="make chaos", description=__doc__)
    parser.add_argument("--forums", type=int, default=defaults.forums)
    parser.add_argument("--line-interval", type=float, default=defaults.line_interval)
    parser.add_argument("--kills-per-service", type=int, default=defaults.kills_per_service)
    parser.add_argument("--outage-seconds", type=float, default=defaults.store_outage_seconds)
    parser.add_argument("--broker-down-seconds", type=float, default=5.0)
    parser.add_argument("--keep", action="store_true", help="keep the vhost and the database")
    args = parser.parse_args()
    try:
        check_local_servers(dict(os.environ))
    except NotOurServers as error:
        print(f"[chaos] {error}", file=sys.stderr)
        return 2
    plan = replace(
        defaults,
        forums=args.forums,
        line_interval=args.line_interval,
        kills_per_service=args.kills_per_service,
        store_outage_seconds=args.outage_seconds,
        keep=args.keep,
    )
    work_dir = LOCAL / "chaos" / time.strftime("%Y%m%d-%H%M%S")
    print(f"[chaos] {plan.forums} forums; logs in {work_dir}", flush=True)
    report = asyncio.run(
        run_chaos(
            plan,
            Servers(AMQP_URL, MONGODB_URL, MANAGEMENT_URL),
            work_dir,
            lambda _vhost: local_server_faults(args.broker_down_seconds),
        )
    )
    print(report.render(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
