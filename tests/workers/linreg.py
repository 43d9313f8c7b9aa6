"""The linear-regression test problem of the optimizer workers: one true weight vector,
a different noisy shard per rank; the noise floor of the MSE is NOISE**2."""
import torch

NOISE = 0.01


def problem(rank, rows=256, dim=5):
    """(W_TRUE [dim, 1], X [rows, dim], Y [rows, 1]) for this rank."""
    torch.manual_seed(0)
    w_true = torch.randn(dim, 1)
    torch.manual_seed(100 + rank)
    x = torch.randn(rows, dim)
    return w_true, x, x @ w_true + NOISE * torch.randn(rows, 1)
