"""The store protocol: what every index on every machine sees in the store.

Save sessions (:mod:`.sessions`), the GC journal and its fences (:mod:`.journal`),
tombstones of removed versions (:mod:`.tombstones`) and moved records of repacked
packs (:mod:`.moved`).  docs/format.md §11 argues why no interleaving breaks it.
"""
