"""The index: a per-machine LMDB cache of what the store holds (refcounts, versions,
tags, sessions), rebuildable from the manifests at any time.  Nothing that skips a
write or deletes an object rests on it alone (docs/format.md §11)."""
