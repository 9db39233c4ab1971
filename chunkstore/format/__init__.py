"""The format: pure encoding and decoding of every stored object, no I/O.

Content ids and the key layout (:mod:`.digest`), dtypes and names, plain data,
manifest nodes and their layout in trees, the config, commit records and tags
(:mod:`.records`), chunk object headers (:mod:`.chunkobj`) and shard geometry.
Byte-level rules are in docs/format.md; the golden fixtures pin them.
"""
