"""A tool call's life, one room per stage.

A call whose answer is not immediate (a worker's, an MCP call past the inline bound) is an
open call in the store with a deadline; the step that made it ends at once, and nothing in
memory waits for it (docs/architecture.md, invariant 12). It ends when whoever settles it
first inserts its end, a unique insert (invariant 8), so every other settler finds it ended.
The winner writes the result line, whose id derives from the call so that a second writer's
copy is a no-op, and deletes the open call; a crash between those steps is finished by the
next reap, which finds an open call that has an end.

- :mod:`.records`: the documents (``OpenCall``, ``CallEnd``, ``CallDecision``), their
  collections and the ids of the lines a call's result goes in.
- :mod:`.repository`: ``OpenCalls``, opening a call, reading it and ending it once.
- :mod:`.answers`: a worker's answer at the door, checked against the call and its sender.
- :mod:`.approvals`: a gated call from its request to its decision and what the decision does.
- :mod:`.approvers`: who may decide, and a decision taken in a person's name.
- :mod:`.stops`: a stop ending a forum's open calls.
- :mod:`.reaper`: deadlines, and what a crash left half done.
- :mod:`.retention`: how long ends and decisions are kept.
- :mod:`.texts`: what the model reads when a call ends without its tool's answer.

Where a call of a round runs in the first place is :mod:`yoke.runtime.dispatch`.
"""
