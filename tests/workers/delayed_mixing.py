"""AWC with overlap="delayed" (docs/design.md §22): the exchange of x_{t+1} starts at the
end of step() t. On a static graph that is AWC's update to the bit; a one-peer schedule
still averages exactly without gradients; clipping, GradScaler, local steps, gradient
accumulation, consensus control and compressed gossip keep working; a parameter changed
while in flight is an error on every rank."""
import sys
import warnings

import torch

import shoal.torch as bf
from linreg import NOISE, problem
from checks import Skip, check, raises, run_all

bf.init()
R, N = bf.rank(), bf.size()
W_TRUE, X, Y = problem(R)
AWC = bf.DistributedAdaptWithCombineOptimizer


class Net(torch.nn.Module):
    """Small parameters (fused into one bucket) and one over 64 KiB (sent alone)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 3)
        self.b = torch.nn.Linear(3, 1)
        self.big = torch.nn.Parameter(torch.zeros(130, 130))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + 1e-3 * self.big.mean()


def run(overlap, make_opt, steps=12, passes=1, every=1, clip=None, scaler=None, **kw):
    """Parameters after each step (and after a final synchronize) of one training run."""
    torch.manual_seed(R)  # different starting points
    model = Net()
    opt = AWC(make_opt(model.parameters()), model, overlap=overlap, num_steps_per_communication=every, **kw)
    history = []
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(passes):  # gradient accumulation over `passes` backward passes
            loss = torch.nn.functional.mse_loss(model(X), Y)
            (scaler.scale(loss) if scaler else loss).backward()
        if clip is not None:
            if scaler:
                opt.synchronize()
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler:
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    opt.synchronize()
    history.append([p.detach().clone() for p in model.parameters()])
    opt.remove_hooks()
    return history, opt


def same(a, b, what):
    for t, (xs, ys) in enumerate(zip(a, b)):
        for x, y in zip(xs, ys):
            assert torch.equal(x, y), f"{what}: step {t} differs: max |d| {(x - y).abs().max().item()}"


SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
ADAM = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731


@check
def delayed_is_awc_to_the_bit_on_a_static_graph():
    """Same exchanges of the same values, started earlier: the trajectories are equal."""
    cases = {"sgd": dict(make_opt=SGD), "adam+clip": dict(make_opt=ADAM, clip=0.5),
             "local steps k=2": dict(make_opt=SGD, every=2), "accumulation k=2": dict(make_opt=SGD, passes=2, every=2),
             "consensus control": dict(make_opt=SGD, consensus_control=bf.ConsensusControl(1e-3, check_every=1)),
             "int8 gossip": dict(make_opt=SGD, compression="int8")}
    for what, kw in cases.items():
        if N == 1 and what == "int8 gossip":
            continue  # one rank has no neighbor to gossip with
        backward, b_opt = run("backward", **kw)
        delayed, d_opt = run("delayed", **kw)
        same(backward[:-1], delayed[:-1], what)
        # The last synchronize installs the exchange started by the last step (none in flight
        # for "backward"): one more neighbor average of the same parameters.
        same(backward[-2:-1], backward[-1:], what + ", nothing in flight")
        if what == "sgd":
            mixed = [bf.neighbor_allreduce(p, name=f"delayed.last.{i}") for i, p in enumerate(backward[-1])]
            same([mixed], delayed[-1:], what + ", the last exchange")
        every, forwards = kw.get("every", 1), 12 * kw.get("passes", 1)
        last = (forwards + 1) % every == 0  # the next forward would communicate: started at the last step()
        assert (b_opt.communications, d_opt.communications) == (forwards // every, forwards // every + last), \
            (what, b_opt.communications, d_opt.communications)


@check
def grad_scaler_sees_whole_gradients():
    if not hasattr(torch.amp, "GradScaler"):
        raise Skip("torch.amp.GradScaler (CPU) needs torch >= 2.3")
    runs = [run(o, SGD, clip=1.0, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))[0]
            for o in ("backward", "delayed")]
    same(runs[0][:-1], runs[1][:-1], "GradScaler")


@check
def one_peer_schedule_averages_exactly_without_gradients():
    """lr 0: the mixes W0 (first forward), W0 (end of step 0), W1, ... average exactly
    once one window of the schedule has been applied."""
    if N & (N - 1):
        raise Skip("exact one-peer averaging needs a power-of-two number of ranks")
    tau = max(1, (N - 1).bit_length())
    model = torch.nn.Linear(4, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.arange(4, dtype=torch.float64) + 8 * R)  # integers: averages are exact
    opt = AWC(torch.optim.SGD(model.parameters(), lr=0.0), model, overlap="delayed")
    schedule = bf.topology.one_peer_exponential_schedule(N, R)
    mean = torch.arange(4, dtype=torch.float64) + 8 * (N - 1) / 2
    for step in range(tau + 3):
        send, recv = next(schedule)
        opt.self_weight, opt.src_weights, opt.dst_weights = 0.5 if recv else 1.0, {r: 0.5 for r in recv}, send
        opt.zero_grad()
        model(X.double()[:, :4]).sum().backward()
        opt.step()
        if step >= tau:  # W0 W0 W1 ... W_{tau-1} installed at step tau
            assert torch.equal(model.weight.detach()[0], mean), (step, model.weight, mean)
    opt.synchronize()
    assert torch.equal(model.weight.detach()[0], mean)
    opt.remove_hooks()


@check
def one_peer_schedule_trains_to_the_noise_floor():
    torch.manual_seed(R)
    model = torch.nn.Linear(5, 1, bias=False)
    opt = AWC(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, overlap="delayed")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=75, gamma=0.3)
    schedule = bf.topology.one_peer_exponential_schedule(N, R)
    for _ in range(300):
        send, recv = next(schedule)
        opt.self_weight, opt.src_weights, opt.dst_weights = 0.5 if recv else 1.0, {r: 0.5 for r in recv}, send
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
        sched.step()
    opt.synchronize()
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(X), Y).item()
    assert loss < 1.5 * NOISE ** 2, loss
    assert torch.allclose(model.weight.detach().t(), W_TRUE, atol=0.01), model.weight
    opt.remove_hooks()


@check
def synchronize_between_steps_drains_without_an_extra_exchange():
    """synchronize() after every step (to evaluate the mixed model, say) installs the
    exchange in flight; the next step only updates: one exchange per step, no warning."""
    torch.manual_seed(R)
    model = torch.nn.Linear(5, 1, bias=False)
    opt = AWC(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model, overlap="delayed")
    bf.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # step() after synchronize() must not warn here
        for _ in range(200):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(X), Y).backward()
            opt.step()
            opt.synchronize()
    # The first forward pass's exchange, then the one each step starts (the last drained).
    assert opt.communications == 201 and bf.stats()["neighbor_allreduce"] == 201, \
        (opt.communications, bf.stats()["neighbor_allreduce"])
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(X), Y).item()
    assert loss < 1.5 * NOISE ** 2, loss
    opt.remove_hooks()


@check
def a_parameter_changed_in_flight_is_an_error_on_every_rank():
    torch.manual_seed(R)
    model = torch.nn.Linear(5, 1)
    opt = AWC(torch.optim.SGD(model.parameters(), lr=0.01), model, overlap="delayed")

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
    step()
    with torch.no_grad():
        model.bias.add_(1.0)  # while x_1 is in flight
    changed = model.bias.detach().clone()
    raises(RuntimeError, step)
    assert torch.equal(model.bias.detach(), changed), "the change was overwritten"
    step()  # the next step starts afresh: nothing in flight, nothing stale
    step()
    opt.synchronize()
    every = bf.allgather(torch.cat([model.weight.detach().ravel(), model.bias.detach()]).reshape(1, -1),
                         name="delayed.after.error")
    assert torch.isfinite(every).all()
    opt.remove_hooks()


@check
def bad_overlap_is_a_value_error():
    model = torch.nn.Linear(2, 1)
    raises(ValueError, AWC, torch.optim.SGD(model.parameters(), lr=0.1), model, overlap="forward")


sys.exit(1 if run_all(R) else 0)
