"""The store handle: an open store's object layer, index, config and caches, its
versions, selectors, tags and removal; what reading, writing and the operations use
(:class:`chunkstore.handle.handle.StoreHandle`)."""
