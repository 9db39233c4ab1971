"""torch_bridge: PyTorch training state in and out of a chunkstore store.

A thin adapter (capture state -> arrays + plain data -> chunkstore); the
Checkpointer, exact resume and export arrive with their own issue.
"""
