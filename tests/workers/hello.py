"""Prints one line to stdout and one to stderr per rank (launcher output tests)."""
import sys

import shoal

shoal.init()
print(f"rank {shoal.rank()} ok", flush=True)
print(f"rank {shoal.rank()} err", file=sys.stderr, flush=True)
