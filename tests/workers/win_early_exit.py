"""Rank 1 stops putting early and exits without win_free; the others keep putting to it
for a while. Shutdown frees the windows collectively, so rank 1 keeps serving their puts
until they are done (a rank inside MPI_Finalize would not, and they would hang)."""
import time

import numpy as np

import shoal

shoal.init()
R = shoal.rank()
x = np.full(1000, float(R))
shoal.win_create(x, "w")
stop = 0.5 if R == 1 else 2.0
start, puts = time.monotonic(), 0
while time.monotonic() - start < stop:
    shoal.win_put(x, "w")
    shoal.win_update("w")
    puts += 1
print(f"[rank {R}] {puts} puts in {stop} s; exiting without win_free", flush=True)
