"""Rank 1 leaves by `how` while the others are inside an op of kind `during`.

    exits.py HOW DURING DIR
    HOW: return | sys_exit | exception | os_exit | sigkill | sigterm | abort | shutdown
    DURING: allreduce | neighbor | window | barrier | broadcast

Every rank writes its pid to DIR/pid<rank> first (the test checks no process is left).
The others print what their op raised, then re-raise it (so the job fails, as a script
that does not catch it would).
"""
import os
import signal
import sys
import time

import numpy as np

import shoal

how, during, directory = sys.argv[1], sys.argv[2], sys.argv[3]
shoal.init()
with open(os.path.join(directory, f"pid{shoal.rank()}"), "w") as f:
    f.write(str(os.getpid()))
shoal.set_topology(shoal.topology.ring_graph(shoal.size()))
x = np.ones(4)
if during == "window":
    shoal.win_create(x, "w")
shoal.barrier()  # everyone is past setup

if shoal.rank() == 1:
    time.sleep(0.5)  # the others are inside their op by now
    if how == "return":
        pass  # the script ends normally
    elif how == "sys_exit":
        sys.exit(3)
    elif how == "exception":
        raise RuntimeError("rank 1 fails on purpose")
    elif how == "os_exit":
        os._exit(3)
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif how == "abort":
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(7)
    elif how == "shutdown":
        shoal.shutdown()
        time.sleep(60)  # stays alive: the others must not wait for it
    else:
        raise SystemExit(f"unknown HOW {how}")
else:
    try:
        for step in range(10 ** 9):
            if during == "allreduce":
                shoal.allreduce(x, name="a")
            elif during == "broadcast":
                shoal.broadcast(x, 1, name="b")
            elif during == "neighbor":
                shoal.neighbor_allreduce(x, name="n")
            elif during == "barrier":
                shoal.barrier()
            elif during == "window":
                # One-sided ops need no peer; the collective at the end of each step does.
                shoal.win_put(x, "w")
                shoal.win_update("w")
                shoal.win_create(np.ones(2), f"w{step}")
    except Exception as exc:
        print(f"rank {shoal.rank()} caught {type(exc).__name__}: {exc}", flush=True)
        raise
