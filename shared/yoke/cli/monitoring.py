"""Prometheus configuration for a mesh on this machine, from the checked-in compose one.

``deploy/prometheus/prometheus.yml`` names docker compose's hosts (``processor:9102``); compose
publishes the same ports on the host, and ``yoke up`` serves them there too. So a local
configuration is that file with every target's host replaced (the port kept), the rule files
given as local paths, and a scrape interval short enough to watch a demo. ``make monitoring``
(``deploy/local/monitoring.sh``) and ``tests/deploy/test_monitoring.py`` both build theirs here.

    python -m yoke.cli.monitoring --source deploy/prometheus/prometheus.yml \
        --rules deploy/prometheus/alerts.yml --out .local/prometheus/prometheus.yml
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from yoke.core.settings import SERVICES

# Replica k (k >= 1) of a service serves its metrics on the service's port + REPLICA_PORT_STEP*k.
REPLICA_PORT_STEP = 10
YOKE_JOB = "yoke"


def local_target(target: str, host: str) -> str:
    """``processor:9102`` -> ``127.0.0.1:9102``."""
    _, _, port = target.rpartition(":")
    return f"{host}:{port}"


def replica_targets(target: str, replicas: int) -> list[str]:
    """The target and, for a shard service's metrics port, replicas 1..replicas-1 (+ 10 k).

    (The gateway serves /metrics on its API port: ``yoke up --replicas`` runs it once.)
    """
    host, _, port = target.rpartition(":")
    if int(port) not in SERVICES.values():
        return [target]
    return [f"{host}:{int(port) + REPLICA_PORT_STEP * k}" for k in range(replicas)]


def local_config(
    source: Mapping[str, Any],
    *,
    rule_files: Sequence[str],
    scrape_interval: str = "5s",
    host: str = "127.0.0.1",
    replicas: int = 1,
    targets: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """``source`` with local targets; ``targets`` replaces a job's targets outright (tests)."""
    config = copy.deepcopy(dict(source))
    config["global"] = {
        **config.get("global", {}),
        "scrape_interval": scrape_interval,
        "evaluation_interval": scrape_interval,
    }
    config["rule_files"] = [str(path) for path in rule_files]
    for job in config.get("scrape_configs", []):
        name = job["job_name"]
        # Compose finds a replicated service's replicas by DNS; here they are name:port too.
        named = [
            f"{host}:{found['port']}"
            for found in job.pop("dns_sd_configs", [])
            for host in found["names"]
        ]
        if named:
            statics = job.setdefault("static_configs", [{"targets": []}])
            statics[0]["targets"] = [*named, *statics[0]["targets"]]
        if targets is not None and name in targets:
            job["static_configs"] = [{"targets": list(targets[name])}]
            continue
        for static in job.get("static_configs", []):
            local = [local_target(target, host) for target in static["targets"]]
            if name == YOKE_JOB:
                local = [r for target in local for r in replica_targets(target, replicas)]
            static["targets"] = local
    return config


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--rules", type=Path, action="append", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scrape-interval", default="5s")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args(argv)
    config = local_config(
        yaml.safe_load(args.source.read_text()),
        rule_files=[str(path.resolve()) for path in args.rules],
        scrape_interval=args.scrape_interval,
        host=args.host,
        replicas=max(1, args.replicas),
    )
    args.out.write_text(yaml.safe_dump(config, sort_keys=False))


if __name__ == "__main__":
    main()
