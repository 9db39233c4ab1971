"""The tiers of a Checkpointer: a fast local store mirrored to a durable one.

:mod:`.mirror` opens the mirror, hands it each published version (a background
replicator, off the training thread), applies retention on both tiers and waits for it;
:mod:`.restore` restores from the nearest tier that holds a version whole and heals the
local tier from the mirror.  docs/recovery.md describes the behaviour for users.
"""
