"""The fake device plugin's NCCL entries called directly (tests/gpu/test_fake_device.py), on
3 ranks with SHOAL_CUDA_PLUGIN=fake: exact collectives and grouped send/recv, and schedules
on which real NCCL deadlocks, mixes data or hangs, which the fake must report as errors:
two ranks issuing two collectives in opposite orders, mismatched sizes, a collective
against grouped send/recv, a cycle of grouped send/recv, two ranks on one device."""
import ctypes
import sys

import numpy as np

import shoal
from checks import check, run_all
from shoal import _gpu
from shoal._ops import DTYPE_CODES
from shoal._loader import _core

shoal.init()
R, N = shoal.rank(), shoal.size()
T = _gpu.plugin()
DEV = R % T.device_count(None)
assert _gpu.is_fake(T.build) and N == 3, (T.build, N)
_ids = iter(range(1 << 30))
SUM, MIN, MAX, PROD = (_core.REDUCE_OPS[k] for k in ("sum", "min", "max", "product"))


def ok(err):
    _gpu.check(err)


def stream():
    s = ctypes.c_void_p()
    ok(T.stream_create(DEV, ctypes.byref(s)))
    return s.value


def comm(ranks, device=None):
    """A communicator of `ranks`: every rank calls this, only members join (None elsewhere)."""
    uid = np.zeros(128, np.uint8)
    if R == ranks[0]:
        ok(T.nccl_unique_id(uid.ctypes.data))
    uid = shoal.broadcast(uid, ranks[0], name=f"nccl.id.{next(_ids)}")
    if R not in ranks:
        return None
    c = ctypes.c_void_p()
    ok(T.nccl_comm_init(DEV if device is None else device, len(ranks), uid.ctypes.data, ranks.index(R),
                        ctypes.byref(c)))
    return c.value


def failure(s):
    """The stream's error after its work ran (None when it all succeeded)."""
    err = T.stream_sync(s)
    return err.decode() if err else None


def exchange(c, s, sends, recvs):
    """sends/recvs: [(peer, numpy array)]; one group on stream s."""
    mk = lambda xs: (_gpu.NcclPeer * max(1, len(xs)))(*[_gpu.NcclPeer(p, a.ctypes.data, a.nbytes) for p, a in xs])
    ok(T.nccl_exchange(mk(sends), len(sends), mk(recvs), len(recvs), c, s))


def bf16(x):
    """float32 values (exact in bfloat16) as bfloat16 bits."""
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


@check
def collectives_exact():
    c, s = comm(list(range(N))), stream()
    for name in ["float16", "float32", "float64", "int8", "uint8", "int32", "int64"]:
        x = (np.arange(5) + 40 * R).astype(name)  # int8: 0+40+80 (+4) wraps like NCCL's
        ok(T.nccl_allreduce(x.ctypes.data, x.size, DTYPE_CODES[name], SUM, c, s))
        assert failure(s) is None
        want = sum((np.arange(5) + 40 * r).astype(name) for r in range(N)).astype(name)
        assert np.array_equal(x, want), (name, x, want)
    b = bf16(np.arange(4) + R)
    ok(T.nccl_allreduce(b.ctypes.data, 4, DTYPE_CODES["bfloat16"], SUM, c, s))
    assert failure(s) is None and np.array_equal(b, bf16(3 * np.arange(4) + 3)), b
    y = np.full(6, R, np.int32)
    ok(T.nccl_broadcast(y.ctypes.data, y.nbytes, N - 1, c, s))
    sizes = np.array([r + 1 for r in range(N)], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    mine, out = np.full(R + 1, R, np.uint8), np.zeros(sizes.sum(), np.uint8)
    i64 = ctypes.POINTER(ctypes.c_int64)
    ok(T.nccl_allgatherv(mine.ctypes.data, out.ctypes.data, sizes.ctypes.data_as(i64), offsets.ctypes.data_as(i64), N,
                         c, s))
    assert failure(s) is None
    assert np.array_equal(y, np.full(6, N - 1, np.int32)), y
    assert np.array_equal(out, np.concatenate([np.full(r + 1, r, np.uint8) for r in range(N)])), out
    err = T.nccl_allreduce(np.zeros(2, np.int16).ctypes.data, 2, DTYPE_CODES["int16"], SUM, c, s)
    assert err and b"int16" in err, err
    # ncclMin/ncclMax/ncclProd: element-wise over the ranks, exact.
    for name in ["float16", "float32", "int8", "int64"]:
        for code, fold in ((MIN, np.minimum), (MAX, np.maximum), (PROD, np.multiply)):
            x = (np.array([3, -2, 1, 5]) * (R + 1) - R).astype(name)
            ok(T.nccl_allreduce(x.ctypes.data, x.size, DTYPE_CODES[name], code, c, s))
            assert failure(s) is None
            want = (np.array([3, -2, 1, 5]) * 1).astype(name)
            for r in range(1, N):
                want = fold(want, (np.array([3, -2, 1, 5]) * (r + 1) - r).astype(name))
            assert np.array_equal(x, want), (name, code, x, want)
    # nccl_reducescatter: uneven shares (grouped ncclReduce) and even ones (ncclReduceScatter).
    i64 = ctypes.POINTER(ctypes.c_int64)
    for shares in ([r + 1 for r in range(N)], [2] * N):
        counts = np.array(shares, np.int64)
        x = (np.arange(counts.sum()) * (R + 1)).astype("float32")
        out = np.zeros(shares[R], np.float32)
        ok(T.nccl_reducescatter(x.ctypes.data, out.ctypes.data, counts.ctypes.data_as(i64), N, DTYPE_CODES["float32"],
                                SUM, c, s))
        assert failure(s) is None
        start = int(counts[:R].sum())
        want = (np.arange(counts.sum()) * (N * (N + 1) // 2)).astype("float32")[start:start + shares[R]]
        assert np.array_equal(out, want), (shares, out, want)


@check
def grouped_send_recv_ring_exact():
    c, s = comm(list(range(N))), stream()
    right, left = (R + 1) % N, (R - 1) % N
    out, got = np.full(7, R, np.float64), np.zeros(7)
    me, back = np.arange(3, dtype=np.int64) + R, np.zeros(3, np.int64)
    exchange(c, s, [(right, out), (R, me)], [(left, got), (R, back)])
    assert failure(s) is None
    assert np.array_equal(got, np.full(7, left, np.float64)) and np.array_equal(back, me), (got, back)


@check
def misordered_collectives_are_reported():
    # Ranks 0 and 1 issue an allreduce and a broadcast in opposite orders on one
    # communicator: real NCCL deadlocks (each waits in a different collective).
    c, s = comm([0, 1]), stream()
    if R == 2:  # not a member; its own communicator is unaffected
        solo, x = comm([2]), np.ones(3, np.float32)
        ok(T.nccl_allreduce(x.ctypes.data, 3, DTYPE_CODES["float32"], SUM, solo, s))
        assert failure(s) is None and np.array_equal(x, np.ones(3, np.float32))
        return
    comm([2])
    a, b = np.ones(4, np.float32), np.ones(16, np.uint8)
    calls = [lambda: T.nccl_allreduce(a.ctypes.data, 4, DTYPE_CODES["float32"], SUM, c, s),
             lambda: T.nccl_broadcast(b.ctypes.data, 16, 0, c, s)]
    for call in calls if R == 0 else calls[::-1]:
        ok(call())  # issuing is fine: the calls fail where they run, on the stream
    err = failure(s)
    print(f"[rank {R}] reported: {err}", flush=True)
    assert err and "would deadlock" in err and "allreduce" in err and "broadcast" in err, err
    assert T.nccl_check(c) and b"would deadlock" in T.nccl_check(c)
    x = np.ones(4, np.float32)  # the communicator is dead from then on, as NCCL's after an error
    assert T.nccl_allreduce(x.ctypes.data, 4, DTYPE_CODES["float32"], SUM, c, stream()) is None


@check
def mismatched_sizes_are_reported():
    c, s = comm(list(range(N))), stream()
    x = np.zeros(4 if R == 0 else 5, np.float32)
    ok(T.nccl_allreduce(x.ctypes.data, x.size, DTYPE_CODES["float32"], SUM, c, s))
    err = failure(s)
    assert err and "disagree" in err and ("4 float32" in err and "5 float32" in err), err
    # Rank 0 sends 16 bytes to rank 1, which expects 8; rank 2 receives what rank 1 sends.
    c, s = comm(list(range(N))), stream()
    buf = np.zeros(16 if R == 0 else 8, np.uint8)
    if R == 0:
        exchange(c, s, [(1, buf)], [])
    elif R == 1:
        exchange(c, s, [(2, buf)], [(0, buf)])
    else:
        exchange(c, s, [], [(1, buf)])
    err = failure(s)
    assert err and ("disagree" in err if R < 2 else "rank 1 failed this call" in err), err


@check
def collective_against_group_is_reported():
    # Ranks 0 and 2 allreduce while rank 1 issues grouped send/recv with rank 0: rank 0
    # and 1 see the disagreement, rank 2 learns it from rank 0 instead of waiting.
    c, s = comm(list(range(N))), stream()
    x = np.zeros(4, np.float32)
    if R == 1:
        exchange(c, s, [(0, x)], [(0, x)])
    else:
        ok(T.nccl_allreduce(x.ctypes.data, 4, DTYPE_CODES["float32"], SUM, c, s))
    err = failure(s)
    assert err and "would deadlock" in err and "grouped send/recv" in err and "allreduce" in err, err
    assert R < 2 or "rank 0 failed this call" in err, err


@check
def cycle_of_grouped_send_recv_is_reported():
    # Each rank exchanges with its right neighbour, then with its left one: rank 0 waits
    # for rank 1's second group, queued behind its first, which waits for rank 2's second,
    # queued behind its first, which waits for rank 0's second. NCCL hangs; the fake times
    # out (SHOAL_FAKE_NCCL_TIMEOUT) with a message.
    c, s = comm(list(range(N))), stream()
    x, y = np.zeros(8, np.uint8), np.zeros(8, np.uint8)
    for peer in ((R + 1) % N, (R - 1) % N):
        exchange(c, s, [(peer, x)], [(peer, y)])
    err = failure(s)
    print(f"[rank {R}] reported: {err}", flush=True)
    assert err and "would hang" in err and "cycle" in err, err


@check
def two_ranks_on_one_device_are_refused():
    uid = np.zeros(128, np.uint8)
    if R == 0:
        ok(T.nccl_unique_id(uid.ctypes.data))
    uid = shoal.broadcast(uid, 0, name=f"nccl.id.{next(_ids)}")
    c = ctypes.c_void_p()
    err = T.nccl_comm_init(0, N, uid.ctypes.data, R, ctypes.byref(c))
    assert err and b"same device" in err, err


def barrier_between(fn):
    def run():
        shoal.barrier()
        fn()
    run.__name__ = fn.__name__
    return run


import checks  # noqa: E402

checks._checks[:] = [barrier_between(f) for f in checks._checks]
sys.exit(1 if run_all(R, report=True) else 0)
