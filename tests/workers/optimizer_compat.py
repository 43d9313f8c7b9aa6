"""BlueFog-compatible surface of the shoal.torch optimizers (issue 14 scope 7; BlueFog
0.3.0 bluefog/torch/optimizers.py, docs/reference/bluefog-semantics.md §3): constructor
keywords and defaults, synchronize()/skip_synchronize(), communication_type,
num_steps_per_communication counting, the deprecated factories, window_prefix and
unregister_window(), push-sum knobs, register_step_function, timeline switches, and the
exception types a script can see. Also the misuse errors that guard gradients in flight."""
import inspect
import sys
import warnings

import torch
import torch.nn.functional as F

import shoal.torch as bf
from shoal.torch import optimizers as shoal_optimizers
from checks import check, raises, run_all
from linreg import problem

bf.init()
R, N = bf.rank(), bf.size()
W_TRUE, X, Y = problem(R)
CT = bf.CommunicationType
NA = CT.neighbor_allreduce


def model_and_sgd(lr=0.05):
    torch.manual_seed(R)
    model = torch.nn.Linear(5, 1, bias=False)
    return model, torch.optim.SGD(model.parameters(), lr=lr)


def backward(model):
    F.mse_loss(model(X), Y).backward()


# BlueFog's signatures (name, default) in order; Shoal may add keywords after them.
BLUEFOG_SIGNATURES = {
    "DistributedAdaptWithCombineOptimizer": [("optimizer", None), ("model", None),
                                             ("communication_type", NA), ("num_steps_per_communication", 1)],
    "DistributedAdaptThenCombineOptimizer": [("optimizer", None), ("model", None),
                                             ("communication_type", NA), ("num_steps_per_communication", 1)],
    "DistributedGradientAllreduceOptimizer": [("optimizer", None), ("model", None),
                                              ("num_steps_per_communication", 1)],
    "DistributedWinPutOptimizer": [("optimizer", None), ("model", None), ("num_steps_per_communication", 1),
                                   ("window_prefix", None)],
    "DistributedPushSumOptimizer": [("optimizer", None), ("model", None), ("num_steps_per_communication", 1)],
    "DistributedAllreduceOptimizer": [("optimizer", None), ("model", None), ("num_steps_per_communication", 1)],
    "DistributedNeighborAllreduceOptimizer": [("optimizer", None), ("model", None),
                                              ("num_steps_per_communication", 1)],
    "DistributedHierarchicalNeighborAllreduceOptimizer": [("optimizer", None), ("model", None),
                                                          ("num_steps_per_communication", 1)],
}
DEPRECATED = {"DistributedAllreduceOptimizer": CT.allreduce,
              "DistributedNeighborAllreduceOptimizer": CT.neighbor_allreduce,
              "DistributedHierarchicalNeighborAllreduceOptimizer": CT.hierarchical_neighbor_allreduce}


def factory(name):
    """The public name (shoal.torch) or, for the deprecated factories that
    bindings/torch/__init__.py may not export yet, the optimizers module's."""
    return getattr(bf, name, None) or getattr(shoal_optimizers, name)


@check
def constructor_keywords_and_defaults_match_bluefog():
    for name, want in BLUEFOG_SIGNATURES.items():
        params = list(inspect.signature(factory(name)).parameters.values())[:len(want)]
        got = [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params]
        assert got == want, (name, got)
    assert {c.name: c.value for c in CT} == {
        "neighbor_allreduce": "neighbor.allreduce", "hierarchical_neighbor_allreduce":
        "hierarchical.neighbor.allreduce", "allreduce": "allreduce", "empty": "empty"}


@check
def deprecated_factories_warn_and_are_awc():
    for name, ctype in DEPRECATED.items():
        model, sgd = model_and_sgd()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = factory(name)(sgd, model, num_steps_per_communication=2)
        assert [w.category for w in caught] == [PendingDeprecationWarning], (name, caught)
        assert isinstance(opt, bf.DistributedAdaptWithCombineOptimizer), name
        assert opt.communication_type is ctype and opt.num_steps_per_communication == 2, name
        opt.remove_hooks()
    model, sgd = model_and_sgd()  # and they train: allreduce makes every rank equal
    opt = factory("DistributedAllreduceOptimizer")(sgd, model)
    bf.reset_stats()
    backward(model)
    opt.step()
    assert bf.stats()["allreduce"] == 1, bf.stats()


@check
def communication_type_is_checked_and_switchable():
    model, sgd = model_and_sgd()
    for bad in ("neighbor_allreduce", 1):
        try:
            bf.DistributedAdaptWithCombineOptimizer(sgd, model, communication_type=bad)
        except TypeError as e:
            assert isinstance(e, AssertionError), "BlueFog raised AssertionError"
        else:
            raise AssertionError(f"communication_type={bad!r} accepted")
    opt = bf.DistributedAdaptWithCombineOptimizer(sgd, model)
    try:
        opt.communication_type = "allreduce"
    except TypeError as e:
        assert isinstance(e, AssertionError)
    else:
        raise AssertionError("a str communication_type was accepted by the setter")
    bf.reset_stats()
    for ctype in (CT.allreduce, CT.neighbor_allreduce, CT.empty):  # as BlueFog's MNIST example
        opt.communication_type = ctype
        opt.zero_grad()
        backward(model)
        opt.step()
    s = bf.stats()
    assert (s["allreduce"], s["neighbor_allreduce"]) == (1, 1), s
    opt.remove_hooks()


@check
def synchronize_then_step_in_skip_synchronize():
    for cls in (bf.DistributedAdaptWithCombineOptimizer, bf.DistributedGradientAllreduceOptimizer):
        model, sgd = model_and_sgd()
        if cls is bf.DistributedGradientAllreduceOptimizer:
            bf.broadcast_parameters(model.state_dict(), 0)
        kw = {"communication_type": CT.allreduce} if cls is bf.DistributedAdaptWithCombineOptimizer else {}
        opt = cls(sgd, model, **kw)
        bf.reset_stats()
        for _ in range(3):
            opt.zero_grad()
            backward(model)
            opt.synchronize()
            # The combined parameters (AWC) or averaged gradients are in: equal everywhere.
            t = model.weight.detach() if kw else model.weight.grad
            every = bf.allgather(t.reshape(1, -1), name="sync.check")
            assert torch.equal(every, every[:1].expand_as(every)), cls.__name__
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
        assert bf.stats()["allreduce"] == 3, (cls.__name__, bf.stats())
        # step() after synchronize() outside skip_synchronize: BlueFog's warning, no second round
        opt.zero_grad()
        backward(model)
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert len(caught) == 1 and "skip_synchronize" in str(caught[0].message), caught
        assert bf.stats()["allreduce"] == 4, (cls.__name__, bf.stats())
        opt.remove_hooks()


@check
def gradients_in_flight_are_guarded():
    model, sgd = model_and_sgd()
    bf.broadcast_parameters(model.state_dict(), 0)
    opt = bf.DistributedGradientAllreduceOptimizer(sgd, model)
    GIF = shoal_optimizers.GradientsInFlightError
    backward(model)
    for exc in (RuntimeError, AssertionError):  # BlueFog: AssertionError; Shoal: RuntimeError
        raises(exc, opt.zero_grad)
    with opt.skip_synchronize():  # step without synchronize() while gradients are in flight
        raises(GIF, opt.step)
    opt.step()
    for touch in (lambda: model.zero_grad(), lambda: model.zero_grad(set_to_none=False),
                  lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)):
        opt.zero_grad()
        backward(model)
        touch()  # between backward and step, without synchronize()
        raises(GIF, opt.step)
    scaler = torch.amp.GradScaler("cpu")  # the plain GradScaler form (see loop_orders.py)
    opt.zero_grad()
    scaler.scale(F.mse_loss(model(X), Y)).backward()
    raises(GIF, scaler.step, opt)
    # Afterwards the optimizer is clean again: a correct step works.
    opt.zero_grad()
    backward(model)
    opt.step()
    every = bf.allgather(model.weight.detach(), name="clean.check")
    assert torch.equal(every, every[:1].expand_as(every))
    opt.remove_hooks()
    # AWC: a step inside skip_synchronize() with parameters in flight would be undone.
    model, sgd = model_and_sgd()
    opt = bf.DistributedAdaptWithCombineOptimizer(sgd, model)
    backward(model)
    opt.zero_grad()  # fine: only parameters are in flight
    with opt.skip_synchronize():
        raises(RuntimeError, opt.step)
    opt.step()
    opt.remove_hooks()


@check
def atc_counts_backward_passes_and_takes_a_step_function():
    model, sgd = model_and_sgd()
    opt = bf.DistributedAdaptThenCombineOptimizer(sgd, model, num_steps_per_communication=3)
    bf.reset_stats()
    backward(model)
    opt.step()  # 1 pass: a local step
    assert bf.stats()["neighbor_allreduce"] == 0
    opt.zero_grad()
    backward(model)
    backward(model)
    opt.step()  # 3 passes: combine (BlueFog counts backward passes)
    assert bf.stats()["neighbor_allreduce"] == 1 and opt.communications == 1, bf.stats()

    model, sgd = model_and_sgd()
    opt = bf.DistributedAdaptThenCombineOptimizer(sgd, model, communication_type=CT.empty)
    calls = []

    def double_sgd(self, p, grad, group):
        calls.append(self)
        p.sub_(2 * group["lr"] * grad)
    raises(TypeError, opt.register_step_function, "not callable")
    opt.register_step_function(double_sgd)
    backward(model)
    before, g = model.weight.detach().clone(), model.weight.grad.clone()
    opt.step()
    assert calls == [opt] and torch.equal(model.weight.detach(), before - (2 * 0.05) * g)
    opt.synchronize()  # nothing in flight: ATC combines inside step()
    with opt.skip_synchronize():
        opt.step()
    opt.remove_hooks()


@check
def timeline_switches_add_and_remove_forward_hooks():
    model, sgd = model_and_sgd()
    opt = bf.DistributedAdaptWithCombineOptimizer(sgd, model)
    base = len(model._forward_hooks)
    opt.turn_on_timeline()
    assert len(model._forward_hooks) == base + 1 and len(model._forward_pre_hooks) == 1
    opt.turn_on_timeline()  # idempotent
    assert len(model._forward_hooks) == base + 1
    opt.zero_grad()
    backward(model)
    opt.step()
    opt.turn_off_timeline()
    assert len(model._forward_hooks) == base and not model._forward_pre_hooks
    opt.remove_hooks()


@check
def win_put_window_prefix_and_unregister_window():
    model, sgd = model_and_sgd()
    opt = bf.DistributedWinPutOptimizer(sgd, model, window_prefix="pfx")
    assert bf.get_current_created_window_names() == ["pfx.weight"], bf.get_current_created_window_names()
    assert (opt.window_prefix, opt.dst_weights, opt.force_barrier) == ("pfx.", None, False)
    opt.zero_grad()
    backward(model)
    opt.step()
    opt.unregister_window()
    assert bf.get_current_created_window_names() == []
    opt.remove_hooks()
    model, sgd = model_and_sgd()
    opt = bf.DistributedWinPutOptimizer(sgd, model)
    assert bf.get_current_created_window_names() == ["weight"]  # BlueFog: the parameter name
    raises(ValueError, bf.DistributedWinPutOptimizer, torch.optim.SGD(model.parameters(), lr=0.1), model)
    raises(TypeError, bf.DistributedWinPutOptimizer, sgd, model, window_prefix=3)
    assert bf.get_current_created_window_names() == ["weight"]
    opt.close()
    opt.remove_hooks()


@check
def push_sum_knobs():
    model, sgd = model_and_sgd()
    opt = bf.DistributedPushSumOptimizer(sgd, model)
    share = 1.0 / (len(bf.out_neighbor_ranks()) + 1)
    assert opt.self_weight == share and opt.dst_weights == {r: share for r in bf.out_neighbor_ranks()}
    assert opt.force_barrier is False  # BlueFog: True; push-sum need not wait (see the docstring)
    bf.reset_stats()
    for _ in range(3):
        opt.zero_grad()
        backward(model)
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
    opt.synchronize()  # the last step's pushes travel until here (they are nonblocking)
    assert bf.stats()["win_accumulates"] == 3 * len(bf.out_neighbor_ranks()), bf.stats()
    opt.close()
    opt.remove_hooks()


sys.exit(1 if run_all(R) else 0)
