"""The object layer: every stored object, by kind and id, through one
:class:`~chunkstore.objects.objectstore.ObjectStore` (the only caller of a backend)."""
