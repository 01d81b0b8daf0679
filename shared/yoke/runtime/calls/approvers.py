"""Who may decide on approvals, and a decision taken in a person's name (``tool.approval.submit``).

A decision comes through a RabbitMQ user the broker verified: the services' own (which the CLI
speaks as), the HTTP gateway's (YOKE_GATEWAY_AMQP_USER), or a publisher made with ``yoke
publisher create --can-approve`` (an :class:`Approver` document, written by the CLI). Each names
its person in ``by``, within its own namespace as for lines (:mod:`yoke.coordination.speakers`); a
tool worker's user never decides. What the decision then does is
:mod:`yoke.runtime.calls.approvals`.
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import Field

from yoke.coordination.speakers import DoorUsers, ForeignNamespace
from yoke.core.models import Document, SubmitApproval, SubmitReply
from yoke.runtime.calls.approvals import Approvals
from yoke.store.database import Store

# The publishers (RabbitMQ users) that may decide, one document each; written by the CLI.
APPROVERS_COLLECTION = "approvers"


class Approver(Document):
    """A publisher that may decide on approvals; ``id`` is its RabbitMQ user name."""

    granted_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


async def grant_approver(store: Store, user: str) -> None:
    """Let the publisher ``user`` decide on approvals (idempotent)."""
    await store.insert_if_absent(store.db[APPROVERS_COLLECTION], Approver(id=user).to_document())


async def revoke_approver(store: Store, user: str) -> bool:
    """Take the right away (at once: the door reads it on every decision); False if ``user``
    had none."""
    result = await store.db[APPROVERS_COLLECTION].delete_one({"_id": user})
    return result.deleted_count > 0


async def is_approver(store: Store, user: str) -> bool:
    found = await store.db[APPROVERS_COLLECTION].find_one({"_id": user}, projection={"_id": 1})
    return found is not None


class Approvers:
    """The door's side of ``tool.approval.submit``: whether its sender may decide, and as whom."""

    def __init__(self, approvals: Approvals, users: DoorUsers) -> None:
        self.approvals = approvals
        self.store = approvals.open_calls.store
        # The services' own RabbitMQ user (the CLI's) and the HTTP gateway's: each names its
        # person; every other user is a publisher, whose people are its own.
        self.users = users

    async def may_decide(self, user: str) -> bool:
        """The mesh's own users, or a publisher granted it; never a tool worker's user."""
        if self.users.is_worker(user):
            return False
        return self.users.is_mesh(user) or await is_approver(self.store, user)

    async def submit(self, command: SubmitApproval, user: str | None) -> SubmitReply:
        """Decide on the call as ``command.by``, speaking through the RabbitMQ ``user`` that
        RabbitMQ verified (None: the command had no ``user_id``)."""
        if not user:
            return SubmitReply.rejected(
                "missing_user_id",
                "the decision has no AMQP user_id: publish it with user_id set to your "
                "RabbitMQ user, which the broker verifies",
            )
        if self.users.is_worker(user):
            return SubmitReply.rejected("not_allowed", self.users.worker_only(user))
        if not await self.may_decide(user):
            return SubmitReply.rejected(
                "not_allowed",
                f"RabbitMQ user {user!r} may not decide on approvals (a publisher made with "
                "yoke publisher create --can-approve may)",
            )
        if command.by is not None:
            try:
                by = self.users.own(user, command.by.external_id, "by.externalId")
            except ForeignNamespace as error:
                return SubmitReply.rejected("foreign_namespace", str(error))
            command = command.model_copy(
                update={"by": command.by.model_copy(update={"external_id": by})}
            )
        return await self.approvals.submit(command)
