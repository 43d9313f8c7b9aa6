"""Expected values of the alltoall workers (a2a_grouped_numpy/torch/tf.py), as numpy arrays:
each rank's input rows, the uneven split pattern, and what a rank receives."""
import numpy as np


def rows(r, d0, width=3):
    """Rank r's [d0, width] input: small integers (exact in every dtype), unique per (r, row)."""
    return ((r * 37 + np.arange(d0)[:, None] * 3 + np.arange(width)) % 97).astype("int64")


def split(r, q):
    """Rows rank r sends to rank q in the uneven pattern (some zero)."""
    return (r + 2 * q) % 3


def received(r, n, splits_of, d0_of, width=3):
    """What rank r of n receives: each rank q's rows for r, in rank order."""
    parts = []
    for q in range(n):
        s = [splits_of(q, k) for k in range(n)]
        start = sum(s[:r])
        parts.append(rows(q, d0_of(q), width)[start:start + s[r]])
    return np.concatenate(parts)
