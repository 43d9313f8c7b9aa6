"""Rank 1 raises an ordinary exception while its peers wait for it."""
import numpy as np

import shoal

shoal.init()
if shoal.rank() == 1:
    raise RuntimeError("rank 1 fails")
shoal.allreduce(np.ones(2), name="never")
