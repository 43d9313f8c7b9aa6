"""Parameter and state utilities on any tensor a user hands them (BlueFog/Horovod
semantics, docs/reference/bluefog-semantics.md §3): leaf tensors that require grad,
nn.Parameters, state_dict()s with buffers, integers, bools, tied and non-contiguous
tensors, parameters()/named_parameters() as lists or generators; broadcast is bit-exact,
the average is sum-then-divide; optimizer state with tensor and scalar entries, empty
state and Shoal wrappers. Run at 3 ranks (dividing by 3 is not multiplying by 1/3)."""
import sys

import torch

import shoal.torch as bf
from checks import check, raises, run_all

bf.init()
R, N = bf.rank(), bf.size()
ROOT = N - 1  # not rank 0: the root argument is honoured


def values(rank, shape=(3, 4), dtype=torch.float32):
    """Rank-dependent values that every rank can compute for any rank."""
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def same_everywhere(t, name):
    every = bf.allgather(t.detach().reshape(1, -1).double(), name=f"same.{name}")
    return torch.equal(every, every[:1].expand_as(every))


def model_of(rank):
    torch.manual_seed(rank)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


@check
def leaf_that_requires_grad_is_broadcast_in_place():
    p = values(R).requires_grad_()
    q = torch.nn.Parameter(values(R, (5,), torch.float64))
    q.grad = torch.full((5,), 7.0, dtype=torch.float64)
    bf.broadcast_parameters({"p": p, "q": q}, ROOT)
    assert torch.equal(p.detach(), values(ROOT)), "not the root's bits"
    assert torch.equal(q.detach(), values(ROOT, (5,), torch.float64))
    assert p.is_leaf and p.requires_grad and p.grad is None
    assert torch.equal(q.grad, torch.full((5,), 7.0, dtype=torch.float64)), "the gradient was touched"
    (p * 2).sum().backward()  # autograd still works on it
    assert torch.equal(p.grad, torch.full_like(p, 2.0))


@check
def every_form_of_a_model_is_broadcast():
    forms = {"state_dict": lambda m: m.state_dict(), "parameters": lambda m: m.parameters(),
             "parameters list": lambda m: list(m.parameters()),
             "named_parameters": lambda m: m.named_parameters(),
             "named_parameters list": lambda m: list(m.named_parameters()),
             "tuple": lambda m: tuple(m.parameters()), "one tensor": lambda m: m[0].weight}
    want = torch.nn.utils.parameters_to_vector(model_of(ROOT).parameters())
    for i, (form, get) in enumerate(forms.items()):
        m = model_of(R)
        ids = [id(p) for p in m.parameters()]
        bf.broadcast_parameters(get(m), ROOT)
        assert [id(p) for p in m.parameters()] == ids
        if form == "one tensor":
            assert torch.equal(m[0].weight.detach(), model_of(ROOT)[0].weight.detach()), form
            continue
        got = torch.nn.utils.parameters_to_vector(m.parameters()).detach()
        assert torch.equal(got, want.detach()), form
        assert all(p.requires_grad and p.is_leaf for p in m.parameters()), form


@check
def state_dict_with_buffers_integers_bools_tied_and_strided_tensors():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec, self.bn = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)
            self.dec.weight = self.enc.weight  # tied: two state_dict keys, one memory
            self.register_buffer("mask", torch.tensor([True, False, True]))

    def net_of(rank):
        torch.manual_seed(rank)
        n = Net()
        n.bn(torch.randn(8, 3) * (rank + 1))  # running stats, num_batches_tracked = rank + 1
        for _ in range(rank):
            n.bn(torch.randn(8, 3))
        n.mask ^= bool(rank % 2)
        return n
    n, ref = net_of(R), net_of(ROOT)
    strided = values(R, (4, 3)).t()  # not contiguous
    assert not strided.is_contiguous()
    bf.broadcast_parameters(n.state_dict(), ROOT)
    bf.broadcast_parameters({"strided": strided}, ROOT)
    for k, v in ref.state_dict().items():
        assert torch.equal(n.state_dict()[k], v), k
    assert torch.equal(strided, values(ROOT, (4, 3)).t())
    assert n.dec.weight is n.enc.weight

    n = net_of(R)
    before = {k: v.clone() for k, v in n.state_dict().items()}
    bf.allreduce_parameters(n.state_dict())
    assert torch.equal(n.bn.num_batches_tracked, before["bn.num_batches_tracked"]), "an integer was averaged"
    assert torch.equal(n.mask, before["mask"]), "a bool was averaged"
    for k in ("enc.weight", "enc.bias", "bn.running_mean"):
        assert same_everywhere(n.state_dict()[k], k), k
    # The tied weight was averaged once, not twice.
    want = bf.allreduce(before["enc.weight"], average=True, name="tied.ref")
    assert torch.equal(n.enc.weight.detach(), want)


@check
def average_is_sum_then_divide():
    for dtype in (torch.float32, torch.float64):
        # Small integers: every sum is exact in any order, so the average has one rounding,
        # the division's (and 6·base + 1 is never a multiple of 3).
        base = torch.arange(1, 41, dtype=dtype).reshape(5, 8)
        mine = torch.nn.Parameter(base * (R + 1) + (R == 0))
        leaf = (base + R).clone().requires_grad_()
        total = sum(base * (r + 1) + (r == 0) for r in range(N))
        want = total / N
        if N == 3:  # the check can tell a division from a multiplication by 1/N
            assert not torch.equal(want, total * (1.0 / N)), "test values do not discriminate"
        bf.allreduce_parameters([mine, ("leaf", leaf)])
        assert torch.equal(mine.detach(), want), (dtype, (mine.detach() - want).abs().max())
        assert torch.equal(leaf.detach(), sum(base + r for r in range(N)) / N)
        assert leaf.requires_grad and leaf.is_leaf


def stepped_adam(steps, lr):
    torch.manual_seed(R)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def assert_state_is_roots(opt, what):
    sd = opt.state_dict()
    every = bf.allgather_object(sd, name=f"state.{what}")
    ref = every[ROOT]
    assert sd["param_groups"] == ref["param_groups"], (what, sd["param_groups"])
    assert sd["state"].keys() == ref["state"].keys(), (what, sd["state"].keys())
    for i, st in ref["state"].items():
        assert st.keys() == sd["state"][i].keys(), what
        for key, v in st.items():
            mine = sd["state"][i][key]
            assert type(mine) is type(v), (what, key, type(mine), type(v))
            if torch.is_tensor(v):
                assert mine.dtype == v.dtype and torch.equal(mine, v), (what, key)
            else:
                assert mine == v, (what, key, mine, v)


@check
def optimizer_state_with_tensors_and_scalars():
    _, adam = stepped_adam(R + 1, 0.01 * (R + 1))  # Adam's step is a tensor
    bf.broadcast_optimizer_state(adam, ROOT)
    assert_state_is_roots(adam, "adam")
    assert adam.state_dict()["state"][0]["step"].item() == ROOT + 1

    _, adam = stepped_adam(1, 0.01)
    for st in adam.state.values():
        st["step"] = float(R + 1)  # an older layout: step as a float
    bf.broadcast_optimizer_state(adam, ROOT)  # Adam's load_state_dict makes it a tensor again
    assert_state_is_roots(adam, "adam float step")
    assert all(float(st["step"]) == float(ROOT + 1) for st in adam.state.values())

    class Counting(torch.optim.Optimizer):
        """Scalar, integer, list and tensor state entries."""
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1, "betas": (0.9, 0.99)})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    st = self.state[p]
                    st["step"] = st.get("step", 0.0) + 1.0
                    st["count"] = st.get("count", 0) + 1
                    st["history"] = st.get("history", []) + [float(R)]
                    st["buf"] = torch.full_like(p, float(R))
    model = torch.nn.Linear(2, 2)
    opt = Counting(model.parameters())
    for _ in range(R + 1):
        opt.step()
    opt.param_groups[0]["betas"] = (0.5, float(R))
    bf.broadcast_optimizer_state(opt, ROOT)
    assert_state_is_roots(opt, "counting")
    assert opt.param_groups[0]["betas"] == (0.5, float(ROOT))


@check
def optimizer_state_empty_stateless_and_wrapped():
    model = torch.nn.Linear(2, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.01 * (R + 1))
    bf.broadcast_optimizer_state(adam, ROOT)  # nobody has stepped
    assert not adam.state and adam.param_groups[0]["lr"] == 0.01 * (ROOT + 1)

    _, adam = stepped_adam(0 if R == ROOT else 2, 0.01)  # only the root has not stepped
    bf.broadcast_optimizer_state(adam, ROOT)
    assert not adam.state_dict()["state"], "state of a never-stepped root not taken"

    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1 * (R + 1))  # stateless after steps too
    model(torch.ones(1, 2)).sum().backward()
    sgd.step()
    bf.broadcast_optimizer_state(sgd, ROOT)
    assert_state_is_roots(sgd, "sgd")

    model, adam = stepped_adam(R + 1, 0.01 * (R + 1))
    wrapped = bf.DistributedAdaptWithCombineOptimizer(adam, model)
    bf.broadcast_optimizer_state(wrapped, ROOT)
    assert_state_is_roots(adam, "wrapped")
    assert_state_is_roots(wrapped, "wrapper")

    raises(ValueError, bf.broadcast_optimizer_state, torch.optim.LBFGS(model.parameters()), ROOT)
    raises(TypeError, bf.broadcast_optimizer_state, {"state": {}}, ROOT)


@check
def objects_with_parameters_and_generators():
    m = model_of(R)
    leaf = values(R).requires_grad_()
    got = bf.broadcast_object({"param": m[0].weight, "leaf": leaf, "sd": m.state_dict(),
                               "named": m.named_parameters()}, root_rank=ROOT)
    ref = model_of(ROOT)
    assert isinstance(got["param"], torch.nn.Parameter) and torch.equal(got["param"], ref[0].weight)
    assert got["leaf"].requires_grad and torch.equal(got["leaf"].detach(), values(ROOT))
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in got["sd"].items())
    assert [n for n, _ in got["named"]] == [n for n, _ in ref.named_parameters()]
    every = bf.allgather_object(m.parameters())
    assert len(every) == N and all(torch.equal(every[r][0], model_of(r)[0].weight) for r in range(N))


@check
def bad_arguments_raise_value_error():
    raises(ValueError, bf.broadcast_parameters, 3, 0)
    raises(ValueError, bf.broadcast_parameters, "weights", 0)
    raises(ValueError, bf.broadcast_parameters, {"x": 1.0}, 0)
    raises(ValueError, bf.allreduce_parameters, None)
    raises(ValueError, bf.allreduce_parameters, [torch.ones(2), "x"])



@check
def ranks_that_pass_different_things_get_one_error():
    """What only one rank passes differently is found before anything moves, and every rank
    raises the same ValueError (they used to wait for names the others never sent)."""
    extra = {"extra": torch.ones(3)} if R == ROOT else {}
    msgs = []
    for call in (lambda: bf.broadcast_parameters({"w": torch.ones(2), **extra}, 0),
                 lambda: bf.broadcast_optimizer_state(
                     (torch.optim.Adam if R == ROOT else torch.optim.SGD)([torch.nn.Parameter(torch.ones(2))], lr=0.1),
                     0),
                 lambda: bf.broadcast_optimizer_state(torch.optim.LBFGS([torch.nn.Parameter(torch.ones(2))]) if R == 0
                                                      else torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1),
                                                      0)):
        try:
            call()
        except ValueError as e:
            msgs.append(str(e))
        else:
            raise AssertionError("accepted")
    assert f"ranks [{ROOT}] differ from rank 0, which has '0.w (2,) torch.float32' where rank {ROOT} has " \
           "'0.extra (3,) torch.float32'" in msgs[0], msgs[0]
    assert f"which has 'SGD' where rank {ROOT} has 'Adam'" in msgs[1], msgs[1]
    assert "has 'LBFGS' where rank 1 has 'SGD'" in msgs[2], msgs[2]
    assert bf.allreduce(torch.ones(1), average=False, name="after.differ").item() == N


sys.exit(1 if run_all(R) else 0)
