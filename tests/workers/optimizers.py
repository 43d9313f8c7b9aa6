"""shoal.torch optimizers: every wrapper x wrapped optimizer x communication type trains
linear regression to the noise floor; state broadcast, step counting, misuse errors,
consensus distance and control."""
import sys

import numpy as np
import torch

import shoal.torch as bf
from linreg import NOISE, problem
from checks import Skip, check, raises, run_all

bf.init()
R, N = bf.rank(), bf.size()
W_TRUE, X, Y = problem(R)
CT = bf.CommunicationType
if bf.machine_size() > 1 and bf.local_size() > 1:
    bf.set_machine_topology(bf.topology.ring_graph(bf.machine_size()))


def train(wrapper, make_opt, ctype, steps=300, **kw):
    torch.manual_seed(R)  # different starting points: communication must pull them together
    model = torch.nn.Linear(5, 1, bias=False)
    inner = make_opt(model.parameters())
    if ctype is None:  # data parallelism needs identical starting points
        bf.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = wrapper(inner, model, **kw) if ctype is None else wrapper(inner, model, communication_type=ctype, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=steps // 4, gamma=0.3)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X), Y)
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(X), Y).item(), model.weight.detach().clone(), opt


OPTS = {"sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=0.05),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=1e-4)}


@check
def every_optimizer_and_communication_type_reaches_noise_floor():
    types = [CT.neighbor_allreduce, CT.allreduce, CT.empty]
    if bf.machine_size() > 1 and bf.local_size() > 1:
        types.append(CT.hierarchical_neighbor_allreduce)
    for oname, make in OPTS.items():
        for wrapper in (bf.DistributedAdaptWithCombineOptimizer, bf.DistributedAdaptThenCombineOptimizer):
            for ct in types:
                loss, w, _ = train(wrapper, make, ct)
                assert loss < 1.5 * NOISE ** 2, (oname, wrapper.__name__, ct, loss)
                assert torch.allclose(w.t(), W_TRUE, atol=0.01), (oname, ct, w)
        loss, w, _ = train(bf.DistributedGradientAllreduceOptimizer, make, None)
        assert loss < 1.5 * NOISE ** 2, (oname, "gradient allreduce", loss)
        every = bf.allgather(w.reshape(1, -1), name=f"same.{oname}")
        assert torch.equal(every, every[:1].expand_as(every)), "gradient allreduce: ranks diverged"


@check
def gradient_buckets_average_exactly_with_unused_parameters():
    # 40 small parameters travel in one bucket, a large one alone; "odd" is used on even
    # ranks only (the others average zeros for it). Gradients are integers: exact means.
    shapes = [(3,)] * 20 + [(2, 2)] * 20 + [(128, 130)]  # the last is over 64 KiB
    model = torch.nn.ParameterDict({f"p{i:02d}": torch.nn.Parameter(torch.zeros(s)) for i, s in enumerate(shapes)})
    model["odd"] = torch.nn.Parameter(torch.zeros(4))
    coef = {n: torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) % 5 + R for n, p in model.items()}
    for k in (1, 2):
        opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                                       num_steps_per_communication=k)
        bf.reset_stats()
        for _ in range(3):
            opt.zero_grad()
            for _ in range(k):
                loss = sum((p * coef[n]).sum() for n, p in model.items() if n != "odd" or R % 2 == 0)
                loss.backward()
            opt.step()
            for n, p in model.items():
                users = N if n != "odd" else (N + 1) // 2
                ranks = range(0, N, 2) if n == "odd" else range(N)
                want = k * sum(coef[n] - R + r for r in ranks) / N
                assert torch.equal(p.grad, want), (n, users, p.grad, want)
        assert bf.stats()["allreduce"] == 3 * 2, bf.stats()  # one bucket and the large one per step
        opt.remove_hooks()
    # A member frozen after the plan was made, and Horovod's predivide (in place on the
    # large gradient): the others still average exactly.
    opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                                   gradient_predivide_factor=2.0)
    model["p00"].requires_grad_(False)
    opt.zero_grad()
    sum((p * coef[n]).sum() for n, p in model.items() if n not in ("odd", "p00")).backward()
    opt.step()
    for n, p in model.items():
        if n not in ("odd", "p00"):
            want = sum(coef[n] - R + r for r in range(N)) / N
            assert torch.equal(p.grad, want), (n, p.grad, want)
    opt.remove_hooks()


@check
def communicates_exactly_every_k_steps():
    for wrapper in (bf.DistributedAdaptWithCombineOptimizer, bf.DistributedAdaptThenCombineOptimizer):
        bf.reset_stats()
        _, _, opt = train(wrapper, OPTS["sgd-momentum"], CT.neighbor_allreduce, steps=30,
                          num_steps_per_communication=3)
        assert opt.communications == 10, (wrapper.__name__, opt.communications)
        assert bf.stats()["neighbor_allreduce"] == 10, bf.stats()  # one parameter tensor
    bf.reset_stats()
    torch.manual_seed(R)
    model = torch.nn.Linear(5, 1, bias=False)
    opt = bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model,
                                                   num_steps_per_communication=2)
    for _ in range(4):
        for _ in range(2):
            torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
        opt.zero_grad()
    assert bf.stats()["allreduce"] == 4 and opt.communications == 4, bf.stats()
    # The local sum of two passes, from a copy (the gradient itself is averaged in place
    # from the second pass on: reading it now would race with the op).
    twin = torch.nn.Linear(5, 1, bias=False)
    twin.load_state_dict(model.state_dict())
    for m in (twin, model):
        torch.nn.functional.mse_loss(m(X), Y).backward()
        torch.nn.functional.mse_loss(m(X), Y).backward()
    averaging = twin.weight.grad
    try:
        torch.nn.functional.mse_loss(model(X), Y).backward()
    except RuntimeError as e:
        assert "backward passes" in str(e)
    else:
        raise AssertionError("a third backward pass was accepted")
    opt.synchronize()  # the gradient in flight was left alone by the rejected pass
    want = bf.allreduce(averaging, average=True, name="two.passes.ref")
    assert torch.equal(model.weight.grad, want), (model.weight.grad, want)


@check
def parameters_in_other_orders_and_changing_shapes():
    """Small parameters travel in flat buckets (bindings/torch/_buckets.py): ranks that list
    them in other orders still combine each with its namesake, exactly; a parameter that
    changes shape on every rank between steps is combined at its new shape."""
    names = ["a", "b", "c", "d"]
    order = names if R % 2 == 0 else names[::-1]  # a ModuleDict built in another order
    model = torch.nn.ModuleDict({k: torch.nn.Linear(3, 2) for k in order})
    with torch.no_grad():
        for k, m in model.items():
            m.weight.fill_(100.0 * names.index(k) + R)
            m.bias.fill_(-100.0 * names.index(k) - R)
    opt = bf.DistributedAdaptThenCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                                  communication_type=CT.allreduce)
    mean = (N - 1) / 2

    def step():
        opt.zero_grad()
        sum(m(torch.ones(1, 3)).sum() for m in model.values()).backward()
        opt.step()
    step()
    for k, m in model.items():
        i = names.index(k)
        assert torch.equal(m.weight, torch.full_like(m.weight, 100.0 * i + mean)), (k, m.weight)
        assert torch.equal(m.bias, torch.full_like(m.bias, -100.0 * i - mean)), (k, m.bias)
    with torch.no_grad():
        model["b"].bias.data = torch.full((2,), float(R))  # same shape, new tensor
        model["c"].weight.data = torch.full((2, 3), float(R)).t().contiguous().t()  # a view
    step()
    assert torch.equal(model["b"].bias, torch.full((2,), mean)), model["b"].bias
    assert torch.equal(model["c"].weight, torch.full((2, 3), mean)), model["c"].weight


@check
def models_that_differ_raise_the_same_error_on_every_rank():
    """A small parameter whose shape differs on one rank: the buckets are compared across
    ranks when they are made (gradient allreduce: at construction; the others: at the first
    communication), so every rank raises one ValueError naming it, instead of stalling on
    buckets whose names do not match."""
    odd = R == N - 1
    def model():
        return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2 + odd))
    messages = []
    for make in (lambda m: bf.DistributedGradientAllreduceOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m),
                 lambda m: bf.DistributedAdaptThenCombineOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)):
        m = model()
        try:
            opt = make(m)
            opt.zero_grad()
            m(torch.ones(1, 3)).sum().backward()
            opt.step()
        except ValueError as e:
            messages.append(str(e))
        else:
            raise AssertionError("models that differ were accepted")
    want = (f"ranks [{N - 1}] differ from rank 0, which has '1.bias (2,) torch.float32' where rank {N - 1} "
            "has '1.bias (3,) torch.float32'")
    assert all(want in msg for msg in messages), messages
    assert bf.allreduce(torch.ones(2), average=False, name="after.models").tolist() == [N, N]


@check
def bucket_copies_keep_torch_semantics():
    """The compiled bucket copies (torch_tensors.cc, flat_copy) give exact values and bump
    version counters as copy_ does (autograd sees a saved parameter being overwritten);
    what they do not take goes through torch: a non-contiguous parameter, a torch function
    mode (which then sees the copy), functionalized tensors."""
    from torch.overrides import TorchFunctionMode

    from shoal.torch import _adapter, _buckets, _tensors
    if _tensors.module() is None or _adapter._FAKE:
        raise Skip("no compiled tensor access here (no C++ compiler, or the fake device)")
    ps = [torch.nn.Parameter(torch.full((2, 3), float(10 * R + i))) for i in range(3)]
    [(_, b)] = _buckets.plan(ps, {p: f"p{i}" for i, p in enumerate(ps)}, "copies")
    assert b._flat_copy(b.flat, 0) and b.still_fits()  # the compiled copies apply
    assert torch.equal(b.gather(), torch.cat([p.detach().reshape(-1) for p in ps]))
    result = torch.arange(18.0)
    versions = [p._version for p in ps]
    b.scatter(result)
    for i, p in enumerate(ps):
        assert torch.equal(p.detach().reshape(-1), result[6 * i:6 * i + 6]), (i, p)
    assert [p._version for p in ps] == [v + 1 for v in versions], [p._version for p in ps]
    loss = (ps[0] * ps[0]).sum()  # saves ps[0] for backward
    b.scatter(result + 1)
    raises(RuntimeError, loss.backward)

    ps[1].data = torch.full((3, 2), -1.0).t()  # same shape, not contiguous
    assert not b._flat_copy(b.flat, 0) and b.still_fits()
    assert torch.equal(b.gather()[6:12], torch.full((6,), -1.0))
    b.scatter(result)
    assert torch.equal(ps[1].detach(), result[6:12].view(2, 3)) and not ps[1].is_contiguous()

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))
    ps[1].data = torch.zeros(2, 3)
    with Seen() as seen:
        b.scatter(result)
    assert any("copy" in c for c in seen.calls), seen.calls
    assert torch.equal(ps[2].detach().reshape(-1), result[12:]), ps[2]

    def functionalized(a, c):  # functionalized tensors may have no memory: torch copies them
        [(_, fb)] = _buckets.plan([a, c], {a: "a", c: "c"}, "functional")
        fb.scatter(torch.arange(5.0))
        return a + 0, c + 0
    got = torch.func.functionalize(functionalized)(torch.ones(2), torch.ones(3))
    assert torch.equal(torch.cat(got), torch.arange(5.0)), got


@check
def list_of_modules_and_parameter_views():
    enc, dec = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    params = list(enc.parameters()) + list(dec.parameters())
    opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(params, lr=0.1), [enc, dec])
    for _ in range(2):
        opt.zero_grad()
        dec(enc(torch.ones(1, 2))).sum().backward()
        opt.step()
    assert opt.communications == 2
    m = torch.nn.Linear(2, 1)
    opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m)
    sd = m.state_dict()  # views of the live parameters must stay valid
    for _ in range(3):
        opt.zero_grad()
        m(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert torch.equal(sd["weight"], m.weight.detach())


@check
def awc_zero_grad_while_parameters_are_in_flight_changes_nothing():
    """zero_grad() after the forward pass (AWC's parameters in flight) trains exactly as
    zero_grad() before it (issue 14: it used to raise)."""
    finals = []
    for after_forward in (False, True):
        torch.manual_seed(R)
        model = torch.nn.Linear(5, 1, bias=False)
        opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.05,
                                                                      momentum=0.5), model)
        for _ in range(5):
            if not after_forward:
                opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(X), Y)
            if after_forward:
                assert opt._handles, "the parameters are not in flight: the check checks nothing"
                opt.zero_grad()
            loss.backward()
            opt.step()
        finals.append(model.weight.detach().clone())
        opt.remove_hooks()
    assert torch.equal(finals[0], finals[1]), finals


@check
def broadcast_optimizer_state_is_bit_identical():
    for oname, make in OPTS.items():
        torch.manual_seed(R)
        model = torch.nn.Linear(5, 3)
        opt = make(model.parameters())
        for _ in range(R + 1):  # different state on every rank
            opt.zero_grad()
            model(X).pow(2).mean().backward()
            opt.step()
        opt.param_groups[0]["lr"] = 0.1 * (R + 1)
        bf.broadcast_parameters(model.state_dict(), root_rank=0)
        bf.broadcast_optimizer_state(opt, root_rank=0)
        blob = bf.allgather_object((opt.state_dict(), {k: v for k, v in model.state_dict().items()}))
        for other in blob[1:]:
            sd0, sd = blob[0][0], other[0]
            assert sd0["param_groups"] == sd["param_groups"], oname
            for k in sd0["state"]:
                for key, v in sd0["state"][k].items():
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(sd["state"][k][key])), (oname, key)
            for k, v in blob[0][1].items():
                assert torch.equal(v, other[1][k])
    # an empty state (never stepped) is broadcast too
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (R + 1))
    bf.broadcast_optimizer_state(opt, 0)
    assert opt.param_groups[0]["lr"] == 0.01


@check
def state_dict_round_trip_and_scheduler():
    model = torch.nn.Linear(5, 1)
    opt = bf.DistributedAdaptThenCombineOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    model(X).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert len(sd["state"]) == 2 and sd["state"][0]["step"] == 1
    opt.load_state_dict(sd)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    sched.step()
    assert opt._opt.param_groups[0]["lr"] == 0.005


@check
def consensus_distance_matches_numpy():
    torch.manual_seed(7 + R)
    ts = [torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    xi = bf.consensus_distance(ts)
    flat = np.concatenate([t.numpy().ravel() for t in ts])
    every = bf.allgather(torch.from_numpy(flat).reshape(1, -1), name="xi.ref").numpy()
    ref = np.sqrt(np.mean(np.sum((every - every.mean(axis=0)) ** 2, axis=1)))
    assert abs(xi - ref) <= 1e-10 * max(ref, 1e-300), (xi, ref)


@check
def consensus_distance_by_shards_in_the_parameters_dtype():
    """float32, bfloat16 and mixed parameters travel in their common dtype, one shard per
    rank (23 elements: uneven shards; 1 element: empty ones): the value is the float64
    reference's; lengths that differ raise ValueError on every rank."""
    torch.manual_seed(11 + R)
    cases = [[torch.randn(7, 3), torch.randn(2)], [torch.randn(5).to(torch.bfloat16)],
             [torch.randn(3, dtype=torch.float64), torch.randn(4).half()], [torch.tensor([float(R)])]]
    for k, ts in enumerate(cases):
        xi = bf.consensus_distance(ts, name=f"xi.case{k}")
        flat = np.concatenate([t.to(torch.float64).numpy().ravel() for t in ts])
        every = bf.allgather(torch.from_numpy(flat).reshape(1, -1), name=f"xi.ref{k}").numpy()
        ref = np.sqrt(np.mean(np.sum((every - every.mean(axis=0)) ** 2, axis=1)))
        assert abs(xi - ref) <= 1e-10 * max(ref, 1e-300), (k, xi, ref)
    if N > 1:
        raises(ValueError, bf.consensus_distance, [torch.zeros(5 + (R == N - 1))], name="xi.bad")
        assert bf.consensus_distance([torch.zeros(3)], name="xi.after") == 0.0  # the job goes on


@check
def consensus_control_keeps_distance_below_target():
    if N == 1:
        raise Skip("needs 2 or more ranks (one rank is always in consensus)")
    torch.manual_seed(R)
    model = torch.nn.Linear(5, 1, bias=False)
    with torch.no_grad():
        model.weight.mul_(10 * (R + 1))  # start far apart
    cc = bf.ConsensusControl(target=0.05, check_every=1, max_extra_rounds=20)
    opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model,
                                                  consensus_control=cc)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
        assert opt.last_consensus_distance <= 0.05, opt.last_consensus_distance
    assert opt.extra_rounds > 0
    assert bf.consensus_distance(model) <= 0.05 + 1e-12


@check
def hierarchical_consensus_control_rounds_run_over_the_machine_topology():
    """Hierarchical AWC's extra rounds are the hierarchical op over the machine topology (a
    ring of 2 machines here): one round averages every rank exactly, so each check adds one
    round and never falls back to allreduce; plain neighbor averaging over the ranks' static
    graph (exponential-2 at 4 ranks: 2 of the 3 others) would leave the ranks apart."""
    if bf.machine_size() != 2 or bf.local_size() != 2:
        raise Skip("needs 2 machines of 2 ranks (SHOAL_RANKS_PER_MACHINE=2 at 4 ranks)")
    torch.manual_seed(R)
    model = torch.nn.Linear(5, 1, bias=False)
    cc = bf.ConsensusControl(target=1e-6, check_every=1, max_extra_rounds=1)
    opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model,
                                                  communication_type=CT.hierarchical_neighbor_allreduce,
                                                  consensus_control=cc)
    for step in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()  # different data per rank: the update moves the ranks apart again
        assert (opt.extra_rounds, opt.exact_averages) == (step + 1, 0), (opt.extra_rounds, opt.exact_averages)
        assert opt.last_consensus_distance <= 1e-6, opt.last_consensus_distance  # (the mean's rounding)
    every = bf.allgather(model.weight.detach().reshape(1, -1), name="cc.hier.check")
    assert torch.equal(every, every[:1].expand_as(every)), every


sys.exit(1 if run_all(R) else 0)
