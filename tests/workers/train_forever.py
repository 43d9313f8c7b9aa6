"""Trains until killed; writes its pid to argv[1]/pid<rank>."""
import os
import sys

import numpy as np

import shoal

shoal.init()
with open(os.path.join(sys.argv[1], f"pid{shoal.rank()}"), "w") as f:
    f.write(str(os.getpid()))
x = np.ones(1000)
while True:
    x = shoal.neighbor_allreduce(x, name="w")
    shoal.allreduce(np.ones(10), name="metric")
