"""Forward + backward time of the NestedLoRA losses: hand-written backward vs autograd.

The autograd baseline differentiates the same estimator written directly (one-shot masked
objective, joint nesting) so both compute the same gradient; the script checks that they
agree before timing. Runs are interleaved and the median is reported, so both sides see the
same machine load.

    python benchmarks/loss_bench.py [--repeats 7] [--device auto|cpu|cuda]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from training.allocator import tune_allocator
from training.device import pick_device
from training.loss import cdk_loss, evd_loss, nesting_masks


def cdk_autograd(f, g, m, M):
    B = f.shape[0]
    ones = f.new_ones(B, 1)
    f, g = torch.cat([ones, f], 1), torch.cat([ones, g], 1)
    lam_f, lam_g = f.T @ f / B, g.T @ g / B
    h = f * g
    operator = -2 * (h.mean(0) * m).sum()
    metric = (B * B * (M * lam_f * lam_g).sum() - ((h @ M) * h).sum()) / (B * (B - 1))
    return operator + metric


def evd_autograd(f, Tf, m, M):
    B1 = (f.shape[0] + 1) // 2
    f1, f2 = f[:B1], f[B1:]
    lam1, lam2 = f1.T @ f1 / len(f1), f2.T @ f2 / len(f2)
    # <f, T f> is quadratic in f: differentiating f against a fixed Tf needs the factor 2.
    operator = -4 * ((f * Tf).mean(0) * m).sum()
    return operator + (M * lam1 * lam2).sum()


def step_time(loss_fn, inputs, sync) -> float:
    leaves = [x.detach().requires_grad_() for x in inputs]
    sync()
    t0 = time.perf_counter()
    loss = loss_fn(*leaves)
    loss.backward()
    sync()
    return time.perf_counter() - t0


def grads(loss_fn, inputs, n):
    leaves = [x.detach().requires_grad_() for x in inputs]
    return torch.autograd.grad(loss_fn(*leaves), leaves[:n])


def bench(name, hand, auto, inputs, n_grad, repeats, sync):
    gh, ga = grads(hand, inputs, n_grad), grads(auto, inputs, n_grad)
    err = max(((a - b).norm() / b.norm()).item() for a, b in zip(gh, ga, strict=True))
    if not err < 1e-4:
        raise SystemExit(f"{name}: the hand-written and autograd gradients differ ({err:.1e})")
    step_time(hand, inputs, sync), step_time(auto, inputs, sync)  # warm-up
    th, ta = [], []
    for _ in range(repeats):
        th.append(step_time(hand, inputs, sync))
        ta.append(step_time(auto, inputs, sync))
    mh, ma = statistics.median(th), statistics.median(ta)
    B, L = inputs[0].shape
    print(
        f"{name:<4} B={B:<5} L={L:<4} hand-written {mh * 1e3:8.2f} ms   autograd {ma * 1e3:8.2f} ms"
        f"   speed-up x{ma / mh:4.2f}   (grad rel. diff {err:.1e})"
    )
    return ma / mh


def main(argv=None):
    tune_allocator()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="auto", help="auto: CUDA when present")
    parser.add_argument("--smoke", action="store_true",
                        help="small sizes, one repeat: checks the benchmark, measures nothing")
    args = parser.parse_args(argv)
    device = pick_device(args.device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    print(f"device {device}, float32, torch {torch.__version__}, threads {torch.get_num_threads()}")
    gen = torch.Generator().manual_seed(0)
    for B, L in [(64, 8)] if args.smoke else [(4096, 512), (512, 16)]:
        f = torch.randn(B, L, generator=gen).to(device)
        g = torch.randn(B, L, generator=gen).to(device)
        # (name, hand-written, autograd, leaves differentiated, CDK masks with constant mode)
        for name, hand, auto, n_grad, constant in [
            ("CDK", cdk_loss, cdk_autograd, 2, True),
            ("EVD", evd_loss, evd_autograd, 1, False),
        ]:
            m, M = (x.float().to(device) for x in nesting_masks(L, constant_mode=constant))
            hand_fn = functools.partial(hand, vector_mask=m, matrix_mask=M)
            auto_fn = functools.partial(auto, m=m, M=M)
            bench(name, hand_fn, auto_fn, [f, g], n_grad, 1 if args.smoke else args.repeats,
                  sync)


if __name__ == "__main__":
    main()
