"""``python -m chunkstore``: the command line."""

from chunkstore.cli import main

main()
