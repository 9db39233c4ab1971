"""The multi-rank path: ranks that save and restore one version together
(:mod:`.ranks`), the collectives they agree through, and shards staged by other
processes (:mod:`.sharded`).  The DCP plugin (:mod:`torch_bridge.dcp`) builds on it."""
