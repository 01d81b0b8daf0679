"""Follow-up: nudges an agent that spoke last in a forum when nobody answered (``scheduler``).

Forum lines of joins that have follow-up arrive as ``conversation.message.posted`` (routed by
``topology.FOLLOWED_HEADER``: other joins' lines cost this service nothing); the scheduler, the
service's background work, fires what is due while the service consumes (its nudges need the
broker).
"""

from __future__ import annotations

from services.followup.scheduler import FollowUps, decision_rule
from yoke.core.models import MessagePosted
from yoke.runtime.service import Service

# The scheduler's name in the log and in /healthz ("follow-up scheduler stopped: ...").
SCHEDULER = "follow-up scheduler"


def register(service: Service) -> None:
    days = service.settings.retention_decision_days
    followups = FollowUps(service.store, service.poster, decision_days=days)
    service.retention.add(decision_rule(days))
    # Only forum lines of joins that have follow-up (topology.FOLLOWED_HEADER): the others'
    # never reach this service.
    service.on_event(
        MessagePosted,
        followups.on_posted,
        where=[{"kind": "forum", "type": "message", "followed": "yes"}],
    )
    service.background(SCHEDULER, lambda: followups.run(service.stopping))
