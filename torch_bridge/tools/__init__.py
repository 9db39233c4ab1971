"""Commands and tools on top of the Checkpointer: export to safetensors, the demo and
its training process, the checkpoint-interval planner, and their CLI commands."""
