"""What a Horovod PyTorch script observes beyond the ops' values (`import shoal.torch as hvd`;
issue 42): `hvd.DistributedOptimizer`'s attributes, warnings and errors, the object helpers
in a process set, and the timeline (Horovod 0.28 horovod/torch/optimizer.py, functions.py,
common/basics.py). Exact values: integer inputs and power-of-two factors.

`python horovod_behaviour.py timeline` instead runs one allreduce named "tl.op" under the
HOROVOD_TIMELINE the job sets, calls start_timeline/stop_timeline as a Horovod script does,
and prints what it saw (tests/test_horovod_torch.py reads the files)."""
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn as nn

import shoal.torch as hvd
from checks import check, raises, run_all

torch.set_num_threads(1)
hvd.init()
R, N = hvd.rank(), hvd.size()


def linear():
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(0.0)
    return model


def backward(model):
    """One backward pass of rank R's batch x = (R + 1) * ones(1, 3), loss = sum of the
    outputs: weight's gradient is R + 1 everywhere, bias's 1."""
    model(torch.full((1, 3), R + 1.0)).sum().backward()


@check
def distributed_optimizer_attributes_and_horovods_errors():
    model = linear()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2,
                                   op=hvd.Average, gradient_predivide_factor=2.0)
    # Horovod's attributes of the optimizer it returns.
    assert opt.backward_passes_per_step == 2 and opt.op is hvd.Average and opt.gradient_predivide_factor == 2.0
    assert opt.sparse_as_dense is False and opt.process_set is hvd.global_process_set
    # Two passes accumulate, then the average goes; a third before step() is Horovod's
    # AssertionError ("Gradients were computed more than backward_passes_per_step times").
    backward(model)
    backward(model)
    try:
        backward(model)
    except AssertionError as e:
        assert isinstance(e, hvd.GradientsInFlightError) and "backward_passes_per_step" in str(e), e
    else:
        raise AssertionError("a third backward pass with backward_passes_per_step=2 was accepted")
    opt.synchronize()
    # Rank r sent 2(r+1) * 1/2; the sum N(N+1)/2, divided by N and times 2: N + 1, exactly.
    assert torch.equal(model.weight.grad, torch.full((2, 3), N + 1.0)), model.weight.grad
    assert torch.equal(model.bias.grad, torch.full((2,), 2.0)), model.bias.grad
    # step() outside skip_synchronize() after synchronize(): Horovod's UserWarning, and
    # the update uses the averages (the exchange is not repeated).
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    assert any(issubclass(w.category, UserWarning) and "skip_synchronize" in str(w.message) for w in seen), \
        [str(w.message) for w in seen]
    assert torch.equal(model.weight.detach(), torch.full((2, 3), 1.0 - 0.5 * (N + 1)))
    # set_backward_passes_per_step (Horovod's): one pass from now on; zero_grad() while
    # it is being averaged is Horovod's AssertionError.
    opt.zero_grad()
    opt.set_backward_passes_per_step(1)
    assert opt.backward_passes_per_step == 1 and opt.num_steps_per_communication == 1
    backward(model)
    raises(AssertionError, opt.zero_grad)
    raises(AssertionError, opt.set_backward_passes_per_step, 3)  # not while gradients are in flight
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    # Rank r's gradient r+1 (factor 1/2, then 2): the average (N+1)/2 again.
    assert torch.equal(model.weight.detach(), torch.full((2, 3), 1.0 - 0.5 * (N + 1) - 0.5 * (N + 1) / 2))
    raises(ValueError, opt.set_backward_passes_per_step, 0)
    opt.remove_hooks()


@check
def distributed_optimizer_refuses_what_horovod_refuses():
    model = linear()

    def make(**kwargs):
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), **kwargs)
    # horovod/torch/optimizer.py: each a ValueError.
    for kwargs in ({"backward_passes_per_step": 0}, {"groups": 0}, {"groups": [[model.weight, model.weight]]},
                   {"groups": [[model.weight], [model.weight]]}, {"groups": [[1.0]]},
                   {"op": hvd.Sum, "gradient_predivide_factor": 2.0}):
        raises(ValueError, make, **kwargs)
    raises(ValueError, hvd.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1),
           named_parameters=[("w", model.weight), ("w", model.bias)])  # duplicate names
    raises(ValueError, hvd.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=0.1),
           named_parameters=[("w", model.weight)])  # a parameter without a name
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ok = make(num_groups=2)  # Horovod's former name of groups: a DeprecationWarning
    assert any(issubclass(w.category, DeprecationWarning) for w in seen), [str(w.message) for w in seen]
    ok.remove_hooks()
    for groups in (2, [[model.weight]]):
        make(groups=groups).remove_hooks()


@check
def object_helpers_in_a_process_set():
    # Horovod's broadcast_object(obj, root_rank, name, process_set) pickles with
    # cloudpickle: a lambda travels. The set of ranks 1..N-1 (rank 0 outside it).
    tail = hvd.add_process_set(list(range(1, N)))
    try:
        if tail.included():
            f = hvd.broadcast_object(lambda v, r=R: 10 * v + r, root_rank=N - 1, name="obj.tail",
                                     process_set=tail)
            assert f(1) == 10 + N - 1
            assert hvd.allgather_object(R, name="obj.tail.ago", process_set=tail) == list(range(1, N))
    finally:
        hvd.remove_process_set(tail)
    got = hvd.broadcast_object({"from": R}, root_rank=N - 1, name="obj.global", process_set=hvd.global_process_set)
    assert got == {"from": N - 1}, got
    assert hvd.broadcast_object(("default", R)) == ("default", 0)  # root_rank=0 by default


@check
def scaling_factors_of_any_real_type():
    # Horovod's binding converts prescale/postscale factors to double: numpy scalars and
    # one-element tensors are factors too; a bool or a str is not (TypeError).
    x = torch.full((3,), R + 1.0)
    total = [N * (N + 1) / 2] * 3
    for pre, post in ((np.float32(0.5), torch.tensor(4.0)), (np.int64(2), np.float64(0.5))):
        want = [t * float(pre) * float(post) for t in total]
        assert hvd.allreduce(x, name="f.ar", op=hvd.Sum, prescale_factor=pre, postscale_factor=post).tolist() == want
        h = hvd.allreduce_async(x, name="f.async", op=hvd.Sum, prescale_factor=pre, postscale_factor=post)
        assert hvd.synchronize(h).tolist() == want
        got = hvd.grouped_allreduce([x], name="f.grouped", op=hvd.Sum, prescale_factor=pre, postscale_factor=post)
        assert got[0].tolist() == want
    for bad in (True, "2"):
        raises(TypeError, hvd.allreduce, x, name="f.bad", op=hvd.Sum, prescale_factor=bad)
        raises(TypeError, hvd.allreduce_async, x, name="f.bad.async", op=hvd.Sum, postscale_factor=bad)


@check
def init_takes_horovods_comm():
    # horovod/common/basics.py init(comm=None, process_sets=None): a list of the ranks to
    # run on. Shoal runs on the whole job: all of them is that (init() again does
    # nothing more); fewer is NotImplementedError; something else ValueError.
    hvd.init(comm=list(range(N)))
    hvd.init(list(reversed(range(N))))  # positional, as Horovod's first argument
    assert hvd.is_initialized() and hvd.size() == N
    raises(NotImplementedError, hvd.init, comm=[0] if N > 1 else [])
    raises(ValueError, hvd.init, comm=["zero"])
    raises(TypeError, hvd.init, [0], comm=[0])
    assert hvd.allreduce(torch.ones(2), name="after.init.comm", op=hvd.Sum).tolist() == [float(N)] * 2


def timeline_job():
    """One named allreduce, Horovod's start/stop calls, then shutdown (closes the files)."""
    dynamic = os.environ.get("HOROVOD_TIMELINE") == "DYNAMIC"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if dynamic:
            hvd.start_timeline(os.path.join(os.getcwd(), "late.json"))
        assert hvd.allreduce(torch.full((4,), R + 1.0), name="tl.op", op=hvd.Sum).tolist() == [N * (N + 1) / 2] * 4
        hvd.stop_timeline()
    print(f"[rank {R}] warnings: {sorted({w.category.__name__ for w in seen})}", flush=True)
    hvd.shutdown()
    print(f"[rank {R}] timeline job done", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["timeline"]:
        timeline_job()
    else:
        sys.exit(run_all(R))
