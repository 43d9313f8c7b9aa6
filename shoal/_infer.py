"""Recover the other side of a communication pattern (collective; BlueFog's
`InferSourceFromDestinationRanks` / `InferDestinationFromSourceRanks`)."""
import numpy as np

from . import _ops
from ._numpy import ADAPTER
from ._process import rank, size


def _adjacency(ranks, what):
    """Allgather every rank's list into A[i, j] = 1 iff rank i listed rank j."""
    n, me = size(), rank()
    ranks = _ops._rank_list(ranks, what)
    bad = [r for r in ranks if not 0 <= r < n or r == me]
    if bad:
        raise ValueError(f"{what}: ranks {bad} are outside [0, {n}) or this rank itself")
    row = np.zeros((1, n), np.uint8)
    row[0, ranks] = 1
    # One name for every call: blocking and collective, so calls never overlap, and the
    # core's per-name tables gain one entry, not one per call.
    return _ops.synchronize(_ops.allgather(ADAPTER, row, name="shoal.infer"))


def _result(a, construct_adjacency_matrix):
    me = rank()
    others = [int(i) for i in np.flatnonzero(a[:, me])]
    if not construct_adjacency_matrix:
        return others
    # W[i, j]: weight receiver j gives sender i; uniform over j's sources and itself.
    w = a.astype(np.float64) + np.eye(a.shape[0])
    return others, w / w.sum(axis=0, keepdims=True)


def InferSourceFromDestinationRanks(dst_ranks, construct_adjacency_matrix=False):
    """Collective. Given this rank's destination ranks, return the ranks that send to it
    (sorted); with construct_adjacency_matrix, also the size×size mixing matrix W with
    W[i, j] = 1/(in_degree(j)+1) for each edge i→j and j's self loop (column-stochastic).
    Raises ValueError for ranks out of range, duplicates or this rank itself."""
    return _result(_adjacency(dst_ranks, "dst_ranks"), construct_adjacency_matrix)


def InferDestinationFromSourceRanks(src_ranks, construct_adjacency_matrix=False):
    """Collective. Given this rank's source ranks, return the ranks it must send to
    (sorted); the optional W is as in `InferSourceFromDestinationRanks` for the edges
    source→this rank. Raises ValueError as there."""
    listed = _adjacency(src_ranks, "src_ranks")  # listed[j, i] = 1 iff j receives from i
    me = rank()
    dsts = [int(j) for j in np.flatnonzero(listed[:, me])]
    if not construct_adjacency_matrix:
        return dsts
    return dsts, _result(listed.T, True)[1]


infer_source_from_destination_ranks = InferSourceFromDestinationRanks
infer_destination_from_source_ranks = InferDestinationFromSourceRanks
