"""Every distributed optimizer with every common training-loop order trains the shared
linear regression (linreg.py) to the noise floor.

For each (optimizer, order) rank 0 prints one line, after gathering every rank's
verdict: `LOOP <optimizer> <order> PASS|FAIL|SKIP <detail>`; tests/test_loop_orders.py
turns each line into its own pytest item (and imports OPTIMIZERS/ORDERS/SKIPS from here,
so this module does nothing at import). A pair passes when, on every rank, the loss is
below 1.5·NOISE², the weights are within 0.01 of the truth, the ranks agree, the
optimizer communicated exactly as often as the order implies (counted by shoal.stats()),
the order's own checks hold and no warning was raised. The window optimizers run with
`force_barrier` (BlueFog's knob): this matrix checks loop orders, and a rank that races
far ahead on shared cores would otherwise end on stale neighbour values
(tests/workers/win_optimizers.py checks that they do not wait for a slow rank).
"""
import sys
import traceback
import warnings

OPTIMIZERS = ("awc", "atc", "gradient_allreduce", "win_put", "push_sum")
ORDERS = ("zero_grad_before_forward", "zero_grad_after_forward", "zero_grad_after_step",
          "set_to_none_false", "model_zero_grad", "grad_accumulation", "local_steps",
          "lr_scheduler", "grad_scaler", "grad_scaler_synchronized")
SKIPS = {
    ("gradient_allreduce", "grad_scaler"):
        "scaler.step(opt) unscales gradients that are still being averaged; gradient allreduce "
        "takes Horovod's form (grad_scaler_synchronized), and the plain form raises "
        "GradientsInFlightError (tests/workers/optimizer_compat.py)",
    ("gradient_allreduce", "local_steps"):
        "local steps between gradient averages let the replicas drift apart for good (BlueFog's "
        "step() averages at every step, too); data parallelism averages every step",
}
STEPS, ACCUMULATE, LOCAL = 80, 4, 2
INF_RANK, INF_AT, INIT_SCALE = 1, 5, 2.0 ** 16


def main():
    import torch
    import torch.nn.functional as F

    import shoal.torch as bf
    from linreg import NOISE, problem

    bf.init()
    R = bf.rank()
    W_TRUE, X, Y = problem(R)

    def make(opt_name, model, k):
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        cls = {"awc": bf.DistributedAdaptWithCombineOptimizer, "atc": bf.DistributedAdaptThenCombineOptimizer,
               "gradient_allreduce": bf.DistributedGradientAllreduceOptimizer,
               "win_put": bf.DistributedWinPutOptimizer, "push_sum": bf.DistributedPushSumOptimizer}[opt_name]
        opt = cls(inner, model, num_steps_per_communication=k)
        if hasattr(opt, "force_barrier"):
            opt.force_barrier = True
        return opt

    def grads(model):
        return [p.grad for p in model.parameters()]

    def scaled(loss, it):  # one overflow, on one rank only: its local update alone is skipped
        return loss * float("inf") if (R == INF_RANK and it == INF_AT) else loss

    def iteration(order, opt, model, it, extra):
        mse = lambda: F.mse_loss(model(X), Y)  # noqa: E731
        if order in ("zero_grad_before_forward", "local_steps", "lr_scheduler"):
            opt.zero_grad()
            mse().backward()
            opt.step()
            if order == "lr_scheduler":
                extra["sched"].step()
        elif order == "zero_grad_after_forward":
            loss = mse()
            opt.zero_grad(set_to_none=True)  # AWC: the parameters are in flight now
            assert all(g is None for g in grads(model)), "set_to_none=True left a gradient"
            loss.backward()
            opt.step()
        elif order == "zero_grad_after_step":
            mse().backward()
            opt.step()
            opt.zero_grad()
        elif order == "set_to_none_false":
            loss = mse()
            before = grads(model)
            opt.zero_grad(set_to_none=False)
            if it > 0:
                assert all(g is b and not g.any() for g, b in zip(grads(model), before)), \
                    "set_to_none=False did not zero the gradients in place"
            loss.backward()
            opt.step()
        elif order == "model_zero_grad":
            loss = mse()
            model.zero_grad()  # bypasses the optimizer
            assert all(g is None for g in grads(model)), "model.zero_grad() left a gradient"
            loss.backward()
            opt.step()
        elif order == "grad_accumulation":
            opt.zero_grad()
            for xb, yb in zip(X.chunk(ACCUMULATE), Y.chunk(ACCUMULATE)):
                (F.mse_loss(model(xb), yb) / ACCUMULATE).backward()
            opt.step()
        elif order == "grad_scaler":
            scaler = extra["scaler"]
            opt.zero_grad()
            scaler.scale(scaled(mse(), it)).backward()
            scaler.step(opt)
            scaler.update()
        elif order == "grad_scaler_synchronized":  # Horovod's form: average, unscale, clip, step
            scaler = extra["scaler"]
            opt.zero_grad()
            scaler.scale(scaled(mse(), it)).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        else:
            raise AssertionError(f"unknown order {order}")

    def expected_counts(opt_name, order):
        """shoal.stats() of the training loop and close() (window ops count per destination)."""
        rounds = STEPS // LOCAL if order == "local_steps" else STEPS
        out = len(bf.out_neighbor_ranks())
        return {"awc": {"neighbor_allreduce": rounds}, "atc": {"neighbor_allreduce": rounds},
                "gradient_allreduce": {"allreduce": rounds},
                # a put's combine comes at the next step: the last put has none
                "win_put": {"win_puts": rounds * out, "win_updates": rounds - 1},
                # close() collects once more
                "push_sum": {"win_accumulates": rounds * out, "win_updates": rounds + 1}}[opt_name]

    def run_pair(opt_name, order):
        """This rank's (error or None, final weight vector)."""
        torch.manual_seed(R)  # different starting points: communication must pull them together
        model = torch.nn.Linear(5, 1, bias=False)
        if opt_name == "gradient_allreduce":  # data parallelism starts from one point
            bf.broadcast_parameters(model.state_dict(), root_rank=0)
        k = {"grad_accumulation": ACCUMULATE, "local_steps": LOCAL}.get(order, 1)
        opt = make(opt_name, model, k)
        extra = {}
        if order == "lr_scheduler":
            extra["sched"] = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=STEPS)
        if order.startswith("grad_scaler"):
            extra["scaler"] = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        problems = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bf.reset_stats()
            try:
                for it in range(STEPS):
                    iteration(order, opt, model, it, extra)
            finally:
                if hasattr(opt, "close"):
                    opt.close()
            stats = bf.stats()
        for key, want in expected_counts(opt_name, order).items():
            if stats[key] != want:
                problems.append(f"{key}={stats[key]}, expected {want}")
        problems += [f"warning: {w.category.__name__}: {w.message}" for w in caught]
        if order == "lr_scheduler":
            lr = opt.param_groups[0]["lr"]
            if not (lr == extra["sched"].get_last_lr()[0] and abs(lr - 0.01) < 1e-12
                    and opt._opt.param_groups[0]["lr"] == lr):
                problems.append(f"the schedule did not reach the optimizer: lr {lr}")
        if order.startswith("grad_scaler"):
            skipped = R == INF_RANK or opt_name == "gradient_allreduce"  # averaged: everyone overflows
            want = INIT_SCALE / 2 if skipped else INIT_SCALE
            if extra["scaler"].get_scale() != want:
                problems.append(f"GradScaler scale {extra['scaler'].get_scale()}, expected {want}")
        with torch.no_grad():
            loss = F.mse_loss(model(X), Y).item()
            w = model.weight.detach().reshape(-1).clone()
        if not loss < 1.5 * NOISE ** 2:
            problems.append(f"loss {loss:.3e} above 1.5·noise² = {1.5 * NOISE ** 2:.1e}")
        err = (w - W_TRUE.reshape(-1)).abs().max().item()
        if not err < 0.01:
            problems.append(f"weights {err:.3e} from the truth")
        return "; ".join(problems) or None, w, loss

    failed = 0
    for opt_name in OPTIMIZERS:
        for order in ORDERS:
            if (opt_name, order) in SKIPS:
                if R == 0:
                    print(f"LOOP {opt_name} {order} SKIP {SKIPS[opt_name, order]}", flush=True)
                continue
            try:
                problem, w, loss = run_pair(opt_name, order)
            except Exception:  # noqa: BLE001 - one line per pair, the others still run
                problem, w, loss = traceback.format_exc().strip().replace("\n", " | "), torch.full((5,), float("nan")), float("nan")
            every = bf.allgather_object((problem, w, loss), name=f"verdict.{opt_name}.{order}")
            ws = torch.stack([e[1] for e in every])
            spread = (ws - ws.mean(0)).abs().max().item()
            bad = [f"rank {r}: {e[0]}" for r, e in enumerate(every) if e[0]]
            same_required = opt_name == "gradient_allreduce"
            if same_required and not torch.equal(ws, ws[:1].expand_as(ws)):
                bad.append(f"gradient allreduce replicas differ by {spread:.3e}")
            elif not spread < 1e-3:
                bad.append(f"ranks disagree by {spread:.3e}")
            failed += bool(bad)
            if R == 0:
                losses = max(e[2] for e in every)
                verdict = "FAIL " + " / ".join(bad) if bad else f"PASS max loss {losses:.3e}, spread {spread:.1e}"
                print(f"LOOP {opt_name} {order} {verdict}", flush=True)
    bf.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
