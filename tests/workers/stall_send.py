"""A large send still in flight when its op fails (the receiver froze past the stall
timeout) keeps reading the sender's tensor: the tensor must stay alive, so the receiver,
once thawed, gets the sender's values and never memory the sender has since reused."""
import gc
import os
import signal
import threading
import time

import numpy as np

from shoal.launcher.rank import rank_from_env

rank = rank_from_env()
os.environ["SHOAL_STALL_SHUTDOWN_TIME"] = "2" if rank == 0 else "6"
import shoal  # noqa: E402  (the stall time is read at init)

shoal.init()
R = shoal.rank()
pids = shoal.allgather(np.array([[os.getpid()]], dtype=np.int64), name="pids")[:, 0]
n = (16 << 20) // 8
kw = dict(enable_topo_check=False, name="big")
if R == 1:
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGSTOP)).start()
    seen = []
    try:
        while True:
            y = shoal.neighbor_allreduce(np.zeros(n), self_weight=0.0, src_weights={0: 1.0}, dst_weights=[], **kw)
            seen.append(float(np.unique(y)[0]) if np.unique(y).size == 1 else float("nan"))
    except shoal.ShoalError:
        pass  # rank 0 stops sending
    assert seen and all(v >= 0 and v == int(v) for v in seen), seen  # step numbers, never reused memory
    print(f"rank 1 received steps {seen}", flush=True)
else:
    step, err = 0, None
    try:
        while True:
            x = np.full(n, float(step))
            shoal.neighbor_allreduce(x, self_weight=1.0, src_weights={}, dst_weights=[1], **kw)
            step += 1
    except shoal.ShoalError as e:
        err = str(e)
    assert "to take its data" in err, err
    del x
    gc.collect()
    junk = [np.full(n, -9.0) for _ in range(3)]  # would reuse a freed tensor's memory
    os.kill(int(pids[1]), signal.SIGCONT)
    time.sleep(3)
    print(f"rank 0: {err}", flush=True)
shoal.shutdown()
print(f"[rank {R}] ok", flush=True)
