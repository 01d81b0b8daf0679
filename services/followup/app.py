"""Follow-up: nudges an agent that spoke last in a forum when nobody answered (``scheduler``).

Forum lines of joins that have follow-up arrive as ``conversation.message.posted`` (routed by
``topology.FOLLOWED_HEADER``: other joins' lines cost this service nothing); the scheduler, the
service's background work, fires what is due while the service consumes (its nudges need the
broker). Beside it, one replica ends the escalations nobody claimed in time (``escalations``).
"""

from __future__ import annotations

from services.followup.escalations import LiveSet, sweep_escalations
from services.followup.scheduler import FollowUps, decision_rule
from yoke.core.models import MessagePosted
from yoke.runtime.escalations import escalation_rules
from yoke.runtime.service import Service

# The scheduler's name in the log and in /healthz ("follow-up scheduler stopped: ...").
SCHEDULER = "follow-up scheduler"
ESCALATION_SWEEP = "escalation sweep"


def live_followups(service: Service) -> LiveSet:
    """This replica and the live ones (its shards' owners), among whom one sweeps."""

    def found() -> tuple[str, list[str]] | None:
        ownership = service.ownership
        if ownership is None or not ownership.live:
            return None
        return ownership.id, ownership.live

    return found


def register(service: Service) -> None:
    days = service.settings.retention_decision_days
    followups = FollowUps(service.store, service.poster, decision_days=days)
    service.retention.add(decision_rule(days))
    for rule in escalation_rules(service.store, days):  # ended escalations, once old
        service.retention.add(rule)
    # Only forum lines of joins that have follow-up (topology.FOLLOWED_HEADER): the others'
    # never reach this service.
    service.on_event(
        MessagePosted,
        followups.on_posted,
        where=[{"kind": "forum", "type": "message", "followed": "yes"}],
    )
    service.background(SCHEDULER, lambda: followups.run(service.stopping))
    service.background(
        ESCALATION_SWEEP,
        lambda: sweep_escalations(
            service.store, service.settings.amqp_url, live_followups(service), service.stopping
        ),
    )
