"""Writing: a save's chunk jobs, dedup decisions, delta encoding, and the commit."""
