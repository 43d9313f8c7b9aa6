"""Rank 1 exits abruptly with status 3 while the others are inside collectives."""
import os
import time

import numpy as np

import shoal

shoal.init()
shoal.allreduce(np.ones(3), name="warmup")
if shoal.rank() == 1:
    time.sleep(0.5)
    os._exit(3)
for i in range(10 ** 9):
    shoal.allreduce(np.ones(3), name="loop")
