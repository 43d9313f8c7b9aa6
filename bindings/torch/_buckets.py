"""Buckets of small parameters for the optimizers' parameter exchanges.

Sending each of a model's 160 small tensors as its own op costs ~10 us of CPU per tensor
in the enqueue path, more than their communication. Parameters below `SMALL` bytes are
therefore copied into one flat buffer per (dtype, device) — up to `BUCKET` bytes each —
and exchanged as one tensor; the combined values are copied back (two `_foreach_copy_`
calls per bucket, not one op per tensor; on the CPU one memcpy per tensor through the
compiled `flat_copy`, about 1 us less per tensor). Larger parameters go alone, as before: a copy
would cost more than it saves. The math is unchanged: neighbor_allreduce and allreduce
act elementwise, so the flat buffer's result is each parameter's result.

Ranks may list their parameters in different orders (a dict of modules, say): buckets are
made in the order of the parameters' names, and a bucket's name carries a digest of its
members' names and shapes, so ranks whose buckets differ never mix their data. Each new
plan is also compared across ranks once (`check_layout`, one collective): a model whose
small parameters differ between ranks (a name, a shape, a dtype) fails there with the same
ValueError on every rank, naming the difference, where its buckets' names would not match.
"""
import zlib

import torch

from shoal import _ops, basics

from . import _tensors, utility
from ._adapter import _FAKE

SMALL = 64 << 10
BUCKET = 4 << 20

_copy = getattr(torch, "_foreach_copy_", None)


def _copy_all(dst, src):
    if _copy is not None:
        _copy(dst, src)
    else:  # torch without _foreach_copy_
        for d, s in zip(dst, src):
            d.copy_(s)


class Bucket:
    """Parameters exchanged through one flat buffer: `flat` (the op's input), `out` (a
    persistent output for ops that take one) and their per-parameter views."""

    def __init__(self, params, names, prefix):
        self.params = params
        self.members = [f"{names[p]} {tuple(p.shape)}" for p in params]
        digest = zlib.crc32("\n".join(self.members + [str(p0_dtype(params))]).encode())
        self.name = f"{prefix}.bucket.{names[params[0]]}.{len(params)}.{digest:08x}"
        p0 = params[0]
        self.signature = [(p.dtype, p.shape, p.device) for p in params]
        self.shapes = [p.shape for p in params]
        total = sum(p.numel() for p in params)
        self.flat = torch.empty(total, dtype=p0.dtype, device=p0.device)
        self.out = torch.empty_like(self.flat)
        self.flat_views = self._views(self.flat)
        self.out_views = self._views(self.out)

    def _views(self, buf):
        views, at = [], 0
        for p in self.params:
            views.append(buf[at:at + p.numel()].view(p.shape))
            at += p.numel()
        return views

    def _flat_copy(self, flat, how):
        """The compiled copy (_tensors.py) if it applies: how 0 checks, 1 gathers, 2 scatters."""
        # Not on the fake device: its tests take the path of real CUDA buckets (torch's copies).
        fast = None if _FAKE else _tensors.module()
        if fast is None:
            return False
        with torch.no_grad():  # as the copies through torch: no autograd record
            return fast.flat_copy(flat, self.params, self.shapes, how)

    def still_fits(self):
        return self._flat_copy(self.flat, 0) or all(p.dtype == d and p.shape == s and p.device == v
                                                    for p, (d, s, v) in zip(self.params, self.signature))

    def gather(self):
        """Copy the parameters' values into `flat` (no autograd record)."""
        if not self._flat_copy(self.flat, 1):
            with torch.no_grad():
                _copy_all(self.flat_views, self.params)
        return self.flat

    def scatter(self, result):
        """Copy an op's result (`out`, `flat` or a fresh flat tensor) into the parameters."""
        with torch.no_grad():
            if self._flat_copy(result, 2):
                return
            views = (self.out_views if result is self.out else self.flat_views if result is self.flat
                     else self._views(result))
            _copy_all(self.params, views)


def synchronize(bucket, handle):
    """`shoal._ops.synchronize` of a bucket's op; an error names the bucket's parameters."""
    try:
        return _ops.synchronize(handle)
    except basics.RankLostError:
        raise  # its own type: the optimizers go on after it (shoal._fault)
    except basics.ShoalError as exc:
        shown = ", ".join(bucket.members[:20]) + (", ..." if len(bucket.members) > 20 else "")
        raise basics.ShoalError(f"{exc} [the op of parameters {shown}]") from exc


def p0_dtype(params):
    return params[0].dtype


def plan(params, names, prefix):
    """[(param, None) | (None, Bucket)]: small dense parameters grouped into buckets by
    dtype and device (in the order of their names), the others alone."""
    out, open_ = [], {}
    for p in sorted(params, key=lambda q: names[q]):
        nbytes = p.numel() * p.element_size()
        if nbytes > SMALL or p.layout != torch.strided:
            out.append((p, None))
            continue
        key = (p.dtype, p.device)
        group = open_.get(key)
        if group is None or group[1] + nbytes > BUCKET:
            group = open_[key] = [[], 0, len(out)]
            out.append(None)  # placeholder: the bucket goes where its first member was
        group[0].append(p)
        group[1] += nbytes
        out[group[2]] = group
    result = []
    for item in out:
        if isinstance(item, list):
            members = item[0]
            if len(members) == 1:
                result.append((members[0], None))
            else:
                result.append((None, Bucket(members, names, prefix)))
        else:
            result.append(item)
    return result


def check_layout(plan, name, process_set=None):
    """Collective and blocking: every rank's `plan` must bucket the same parameters (names,
    shapes, dtypes). Raises ValueError, the same on every rank, naming the first parameter
    that differs (utility.agree; the ranks of `process_set` when given). Once per plan."""
    lines = [f"{m} {b.params[0].dtype}" for _, b in plan if b is not None for m in b.members]
    utility.agree(lines, "the models' small parameters", name, "(name, shape, dtype); every rank's model must "
                  "have the same parameters", process_set)
