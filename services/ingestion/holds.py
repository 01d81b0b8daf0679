"""The door's part in people taking over (docs/people-take-over.md).

- A ``/takeover`` or ``/handback`` line is decided before it is stored (:meth:`HoldDoor.decide`:
  who may type it, whether the forum is free or held) and its record in ``forum_holds`` applied
  once it is (:meth:`HoldDoor.recorded`). A repeat of a line already stored skips the checks,
  which its first delivery passed, and applies the record again: a crash between the line and
  its record leaves nothing half done.
- ``escalation.submit`` (:class:`EscalationDecisions`): a claim, cancel or timeout of an
  escalation, decided once by a unique insert; the winner carries the decision out (a claim as
  its claimer's ``/takeover`` line, a cancel or timeout as an instruction line in the agent's
  monologue), and a repeat of the same decision finishes whatever a crash left undone.

Both run in the forum's lane (the commands are keyed by the forum), so nothing else decides for
that forum meanwhile. Nothing here is read for a line that is no hold command.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from pydantic import JsonValue

from yoke.coordination.speakers import DoorUsers, ForeignNamespace
from yoke.core import tracing
from yoke.core.ids import SYSTEM_ACTOR_ID, derive_id, submitted_line_id
from yoke.core.metrics import ESCALATION_CLAIM_SECONDS, ESCALATIONS_ENDED, HOLDS
from yoke.core.models import (
    CommandAuthor,
    EscalationClaimed,
    EscalationEnded,
    EscalationOutcome,
    Message,
    MessageMeta,
    ShownPerson,
    SubmitEscalation,
    SubmitReply,
    TextPart,
    as_utc,
    utcnow,
)
from yoke.core.slash import TAKEOVER, SlashCommand, hold_command
from yoke.runtime.chain import carry_tail, copy_target
from yoke.runtime.escalations import (
    HANDOFF_INSTRUCTION,
    Escalation,
    EscalationDecision,
    Escalations,
)
from yoke.runtime.holds import MAX_HOLD_REASON_CHARS, ForumHold, Holds, allowed_to_hold
from yoke.runtime.joins import participant_id
from yoke.runtime.posting import Poster
from yoke.store.database import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HoldLine:
    """A ``/takeover`` or ``/handback`` the door writes, and what its record is once stored."""

    takeover: bool
    author: CommandAuthor  # as the door stores it (namespaced)
    reason: str | None = None
    # A takeover's: the escalation it claims; a handback's: the one its hold claimed.
    escalation_id: str | None = None
    # A handback's: the /takeover line whose hold it ends.
    ends_hold: str | None = None
    repeat: bool = False

    @property
    def what(self) -> str:
        return "takeover" if self.takeover else "handback"

    def meta(self) -> dict[str, JsonValue]:
        """What the door sets on the line's meta (a command's keys by these names are dropped)."""
        if self.takeover:
            return {"escalationId": self.escalation_id} if self.escalation_id else {}
        return {"endsHold": self.ends_hold} if self.ends_hold else {}


def _since(moment: datetime) -> str:
    return f"{as_utc(moment):%Y-%m-%d %H:%M:%S} UTC"


class HoldDoor:
    """Who may take a forum over or hand it back, and the record of who holds it."""

    def __init__(self, store: Store, poster: Poster, users: DoorUsers) -> None:
        self.store = store
        self.poster = poster
        self.users = users
        self.holds = Holds(store)
        self.escalations = Escalations(store)

    async def decide(
        self,
        forum_id: str,
        command: SlashCommand,
        message_id: str,
        author: CommandAuthor,
        user: str,
        *,
        hold_granted: bool = False,
        escalation_id: str | None = None,
    ) -> HoldLine | SubmitReply | None:
        """The hold line to write, or why not. ``hold_granted`` counts only from the mesh's
        own users (the CLI's, the gateway's for a token with the right); anyone else must be
        in some join's ``takeoverBy``, or, to hand back, hold the forum. A repeat is the
        stored line's, whatever the command now says (None: the stored line holds nothing, a
        key reused for a /takeover takes nothing over)."""
        takeover = command.name == TAKEOVER
        reason = command.argument[:MAX_HOLD_REASON_CHARS] or None
        existing = await self.store.get_message(message_id)
        if existing is not None:
            return await self._repeat(existing)
        granted = hold_granted and self.users.is_mesh(user)
        hold = await self.holds.get(forum_id)
        if takeover:
            if not granted and not await allowed_to_hold(self.store, forum_id, author.external_id):
                return self._not_allowed(author, "take this forum over")
            if hold is not None:
                return SubmitReply.rejected(
                    "held",
                    f"held by {hold.holder.display_name} since {_since(hold.since)}: it must be "
                    "handed back (/handback) before anyone takes it over",
                )
            return HoldLine(True, author, reason, escalation_id)
        holder = hold is not None and hold.holder.external_id == author.external_id
        if not (
            granted or holder or await allowed_to_hold(self.store, forum_id, author.external_id)
        ):
            return self._not_allowed(author, "hand this forum back")
        if hold is None:
            return SubmitReply.rejected("not_held", "nobody holds this forum: nothing to hand back")
        return HoldLine(False, author, escalation_id=hold.escalation_id, ends_hold=hold.line_id)

    @staticmethod
    def _not_allowed(author: CommandAuthor, what: str) -> SubmitReply:
        return SubmitReply.rejected(
            "not_allowed",
            f"{author.external_id!r} may not {what}: only people a join names in takeoverBy, "
            "the CLI and tokens made with --can-take-over may (a holder may hand back)",
        )

    async def _repeat(self, line: Message) -> HoldLine | None:
        """A line already stored: its record as the stored line says it (its text, its
        author), to apply again; None when it is no hold line."""
        stored = hold_command(line.text) if line.role == "user" else None
        if stored is None:
            return None
        actor = await self.store.get_actor(line.author_actor_id)
        author = CommandAuthor(
            external_id=(actor.external_id if actor is not None else None) or line.author_actor_id,
            display_name=actor.name if actor is not None else "someone",
        )
        if stored.name == TAKEOVER:
            reason = stored.argument[:MAX_HOLD_REASON_CHARS] or None
            return HoldLine(True, author, reason, line.meta.escalation_id, repeat=True)
        ended = line.meta.ends_hold
        taken = await self.store.get_message(ended) if ended else None
        return HoldLine(
            False,
            author,
            escalation_id=taken.meta.escalation_id if taken is not None else None,
            ends_hold=ended,
            repeat=True,
        )

    async def recorded(self, line: Message, hold: HoldLine, created: bool) -> None:
        """The stored ``line``'s record: taken, or released (and the escalation its hold
        claimed ended). Idempotent: a repeat applies what its first delivery may not have."""
        if hold.takeover:
            if hold.repeat and await self._handed_back(line):
                return  # a repeat of a takeover that was since handed back holds nothing now
            await self.holds.take(
                ForumHold.model_validate(
                    {
                        "_id": line.conversation_id,
                        "lineId": line.id,
                        "holder": hold.author,
                        "reason": hold.reason,
                        "since": line.created_at,
                        "escalationId": hold.escalation_id,
                    }
                )
            )
            await self._claim_open(line, hold)
        else:
            if hold.ends_hold is not None:
                await self.holds.release(line.conversation_id, hold.ends_hold)
            await self._end_claimed(line, hold)
        if created:
            HOLDS.labels(hold.what).inc()
        log.info(
            "%s by %s%s",
            hold.what,
            hold.author.display_name,
            " (again)" if not created else "",
            extra={"conversationId": line.conversation_id, "messageId": line.id},
        )

    async def note_claim(self, escalation: Escalation, by: CommandAuthor, at: datetime) -> None:
        """The claim that stands, recorded and announced (again on a repeat: one event id)."""
        if escalation.state == "open":
            await self.escalations.mark_claimed(escalation.id, by, at)
            seconds = (as_utc(at) - as_utc(escalation.opened_at)).total_seconds()
            ESCALATION_CLAIM_SECONDS.observe(max(0.0, seconds), tracing.exemplar())
            ESCALATIONS_ENDED.labels("claimed").inc()
        claimed = EscalationClaimed(
            escalation_id=escalation.id,
            forum_id=escalation.forum_id,
            by=ShownPerson(display_name=by.display_name),
            claimed_at=at,
        )
        await self.poster.bus.publish_forum_event(
            derive_id("escalation-claimed", escalation.id), claimed
        )
        log.info(
            "escalation %s claimed by %s",
            escalation.id,
            by.display_name,
            extra={"conversationId": escalation.forum_id},
        )

    async def _claim_open(self, line: Message, hold: HoldLine) -> None:
        """A takeover answers every request for a person open in its forum: each is claimed by
        the taker (the first decision stands: one a timeout won stays as it ended)."""
        for escalation in await self.escalations.listed(
            states=("open",), forum_ids=[line.conversation_id]
        ):
            won, decision = await self.escalations.decide(escalation.id, "claim", hold.author)
            same = decision.action == "claim" and decision.by == hold.author
            if won or same:
                await self.note_claim(escalation, hold.author, decision.at)

    async def _end_claimed(self, line: Message, hold: HoldLine) -> None:
        """A hand-back ends every escalation its forum's hold answered (claimed through the
        inbox, or by a takeover of a forum whose agent waited on one)."""
        claimed = await self.escalations.listed(
            states=("claimed",), forum_ids=[line.conversation_id]
        )
        ids = {escalation.id for escalation in claimed}
        if hold.escalation_id is not None and hold.escalation_id not in ids:
            ids.add(hold.escalation_id)  # a repeat, after its first delivery ended it
        for escalation_id in sorted(ids):
            await self._handed_back_escalation(escalation_id, line)

    async def _handed_back(self, takeover: Message) -> bool:
        """Whether a /handback ended ``takeover``'s hold (read only for a repeated takeover)."""
        found = await self.store.messages.find_one(
            {"conversationId": takeover.conversation_id, "meta.endsHold": takeover.id},
            {"_id": 1},
        )
        return found is not None

    async def _handed_back_escalation(self, escalation_id: str, line: Message) -> None:
        escalation = await self.escalations.get(escalation_id)
        if escalation is None:
            return
        if escalation.state != "ended":
            await self.escalations.mark_ended(escalation_id, "handed_back", line.created_at)
        await self.announce_end(escalation, "handed_back", line.created_at)

    async def announce_end(
        self, escalation: Escalation, outcome: EscalationOutcome, at: datetime
    ) -> None:
        ended = EscalationEnded(
            escalation_id=escalation.id, forum_id=escalation.forum_id, outcome=outcome, ended_at=at
        )
        await self.poster.bus.publish_forum_event(
            derive_id("escalation-ended", escalation.id), ended
        )


class HoldLines(Protocol):
    """How a hold line is written: the door's own way for any line (see ``Door.post_line``)."""

    async def post_line(
        self,
        forum_id: str,
        author: CommandAuthor,
        text: str,
        message_id: str,
        *,
        user: str,
        hold_granted: bool = False,
        escalation_id: str | None = None,
    ) -> SubmitReply: ...


def claim_line_id(escalation: Escalation) -> str:
    """The /takeover line a claim writes: one per escalation, whoever claims it."""
    return submitted_line_id(escalation.forum_id, derive_id("escalation-claim", escalation.id))


def end_line_id(escalation_id: str) -> str:
    """The instruction line a timeout or cancel writes into the agent's monologue."""
    return derive_id("escalation-end", escalation_id)


class EscalationDecisions:
    """``escalation.submit``: who may decide, the one decision, and carrying it out."""

    def __init__(self, holds: HoldDoor, lines: HoldLines) -> None:
        self.holds = holds
        self.lines = lines
        self.store = holds.store
        self.poster = holds.poster
        self.users = holds.users
        self.escalations = holds.escalations

    async def submit(self, command: SubmitEscalation, user: str | None) -> SubmitReply:
        if not user or not self.users.is_mesh(user):
            return SubmitReply.rejected(
                "not_allowed",
                "escalations are decided by the mesh's own users only (the CLI, the follow-up "
                "service, the HTTP gateway)",
            )
        by = command.by
        if by is not None:
            try:
                by = CommandAuthor(
                    external_id=self.users.own(user, by.external_id, "by.externalId"),
                    display_name=by.display_name,
                )
            except ForeignNamespace as error:
                return SubmitReply.rejected("foreign_namespace", str(error))
        if command.action == "claim" and by is None:
            return SubmitReply.rejected("invalid_command", "a claim names who claims (by)")
        escalation = await self.escalations.get(command.escalation_id)
        if escalation is None or escalation.forum_id != command.conversation_id:
            return SubmitReply.rejected(
                "unknown_escalation",
                f"no escalation {command.escalation_id!r} in forum {command.conversation_id!r}",
            )
        if command.action == "timeout" and utcnow() < as_utc(escalation.deadline):
            return SubmitReply.rejected(
                "invalid_command",
                f"escalation {escalation.id!r} is not due until {_since(escalation.deadline)}",
            )
        if command.action == "claim":
            forum = await self.holds.store.get_conversation(escalation.forum_id)
            if forum is not None and forum.kept_for is not None:
                # Only the forum's outside caller writes there: its holder could say nothing,
                # nor hand it back (the agent refuses to ask for a person there anyway).
                return SubmitReply.rejected(
                    "not_claimable",
                    f"escalation {escalation.id!r} is in a forum kept for an outside caller "
                    "(MCP or A2A): nobody can take it over",
                )
            hold = await self.holds.holds.get(escalation.forum_id)
            if hold is not None and hold.escalation_id != escalation.id:
                return SubmitReply.rejected(
                    "held",
                    f"held by {hold.holder.display_name} since {_since(hold.since)}: the "
                    "escalation can be claimed once it is handed back",
                )
        won, decision = await self.escalations.decide(escalation.id, command.action, by)
        if not won and not _same(decision, command, by):
            return _lost(escalation, decision)
        if not won and decision.action == "claim" and escalation.state == "ended":
            # Its claim was carried out and its hold handed back: nothing is left to finish,
            # and announcing the claim again after its end would only mislead a helpdesk.
            return SubmitReply.rejected(
                "escalation_ended",
                f"escalation {escalation.id!r} has ended ({escalation.outcome or 'ended'})",
            )
        tracing.annotate({"yoke.escalation_id": escalation.id})
        if decision.action == "claim":
            assert decision.by is not None  # a claim names its claimer (checked above)
            reply = await self._claim(escalation, decision, decision.by, user)
        else:
            reply = await self._end(escalation, decision)
        if reply.status == "rejected":
            return reply
        return reply.model_copy(update={"duplicate": not won})

    async def _claim(
        self, escalation: Escalation, decision: EscalationDecision, by: CommandAuthor, user: str
    ) -> SubmitReply:
        """The claim that stands, carried out (a ``claim`` span: the takeover it writes, and
        the agents' steps that hold, are in its trace)."""
        with tracing.span(
            "claim",
            attributes={
                tracing.FORUM_ID: escalation.forum_id,
                "yoke.escalation_id": escalation.id,
            },
        ):
            return await self._carry_out_claim(escalation, decision, by, user)

    async def _carry_out_claim(
        self, escalation: Escalation, decision: EscalationDecision, by: CommandAuthor, user: str
    ) -> SubmitReply:
        await self.holds.note_claim(escalation, by, decision.at)
        return await self.lines.post_line(
            escalation.forum_id,
            by,
            # Not the reason: a model wrote it, and a person's line is their own words.
            TAKEOVER,
            claim_line_id(escalation),
            user=user,
            hold_granted=True,
            escalation_id=escalation.id,
        )

    async def _end(self, escalation: Escalation, decision: EscalationDecision) -> SubmitReply:
        outcome: EscalationOutcome = "timed_out" if decision.action == "timeout" else "canceled"
        line = await self._instruct(escalation, _end_text(escalation, decision))
        if escalation.state != "ended":
            await self.escalations.mark_ended(escalation.id, outcome, decision.at)
            ESCALATIONS_ENDED.labels(outcome).inc()
        await self.holds.announce_end(escalation, outcome, decision.at)
        log.info(
            "escalation %s %s",
            escalation.id,
            outcome,
            extra={"conversationId": escalation.forum_id, "messageId": line.id if line else None},
        )
        return SubmitReply(status="accepted", message_id=line.id if line else None)

    async def _instruct(self, escalation: Escalation, text: str) -> Message | None:
        """The instruction into the agent's current monologue (None: the agent left the
        forum): its id derives from the escalation, so however often this runs it is one line."""
        written = await self.store.get_message(end_line_id(escalation.id))
        if written is not None:
            return written
        participant = await self.store.get_participant(
            participant_id(escalation.forum_id, escalation.agent_actor_id)
        )
        if (
            participant is None
            or participant.left_at is not None
            or not participant.metadata.get("monologueId")
        ):
            log.warning(
                "escalation %s ended with no monologue to tell",
                escalation.id,
                extra={"conversationId": escalation.forum_id},
            )
            return None
        monologue_id = await copy_target(self.store, self.poster, participant, escalation.join_key)
        line = await self.poster.post(
            Message(
                id=end_line_id(escalation.id),
                conversation_id=monologue_id,
                author_actor_id=SYSTEM_ACTOR_ID,
                role="user",
                type="message",
                parts=[TextPart(text=text)],
                meta=MessageMeta.model_validate(
                    {
                        "sourceConversationId": escalation.forum_id,
                        "instruction": HANDOFF_INSTRUCTION,
                        "escalationId": escalation.id,
                    }
                ),
            )
        )
        # The monologue may have been compacted meanwhile: if so, the line is carried on.
        await carry_tail(self.store, self.poster, participant.id, monologue_id, line.seq)
        return line


def _same(
    decision: EscalationDecision, command: SubmitEscalation, by: CommandAuthor | None
) -> bool:
    """The standing decision is this one again (the same side: a crash, or asked twice)."""
    standing = decision.by.external_id if decision.by is not None else None
    asking = by.external_id if by is not None else None
    return decision.action == command.action and standing == asking


def _lost(escalation: Escalation, decision: EscalationDecision) -> SubmitReply:
    name = decision.by.display_name if decision.by is not None else "nobody"
    if decision.action == "claim":
        return SubmitReply.rejected("already_claimed", f"claimed by {name}")
    how = "timed out" if decision.action == "timeout" else f"canceled by {name}"
    return SubmitReply.rejected("escalation_ended", f"escalation {escalation.id!r} {how}")


def _end_text(escalation: Escalation, decision: EscalationDecision) -> str:
    if decision.action == "timeout":
        seconds = (as_utc(escalation.deadline) - as_utc(escalation.opened_at)).total_seconds()
        return f"No person claimed the escalation within {round(seconds)} s."
    name = decision.by.display_name if decision.by is not None else "someone"
    return f"The request for a person was canceled by {name}."
