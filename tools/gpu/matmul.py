"""The GPU check's ceiling for model FLOP utilisation, measured on the spot: the rate of
one large matrix product through torch, as JSON on stdout.

  matmul.py [--device cuda|cpu] [--n N] [--dtype bf16|fp32] [--repeat R]

C = A @ B with A, B of N x N random values (never zeros, which run faster than real
data): 2 N^3 FLOPs each. On cuda: three warm-up products, then R timed ones between CUDA
events; the median time gives the TFLOP/s. On cpu (the check's rehearsal): the same
with a wall clock, at a size a CPU finishes.
"""
import argparse
import statistics
import sys
import time

sys.dont_write_bytecode = True  # no __pycache__ left in the tree that travels
import json_stdout  # noqa: E402  (tools/gpu/json_stdout.py, beside this file)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    import torch
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    dev = torch.device(a.device)
    gen = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(a.n, a.n, device=dev, dtype=torch.float32, generator=gen).to(dtype)
    y = torch.randn(a.n, a.n, device=dev, dtype=torch.float32, generator=gen).to(dtype)
    flops = 2.0 * a.n ** 3
    times = []
    if dev.type == "cuda":
        for _ in range(3):
            torch.matmul(x, y)
        torch.cuda.synchronize()
        for _ in range(a.repeat):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            z = torch.matmul(x, y)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        finite = bool(torch.isfinite(z).all().item())
    else:
        torch.matmul(x, y)
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            z = torch.matmul(x, y)
            times.append(time.perf_counter() - t0)
        finite = bool(torch.isfinite(z).all().item())
    med = statistics.median(times)
    out = {
        "device": a.device,
        "name": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "dtype": a.dtype,
        "n": a.n,
        "repeat": a.repeat,
        "median_s": med,
        "best_s": min(times),
        "tflops_median": flops / med / 1e12,
        "tflops_best": flops / min(times) / 1e12,
        "finite": finite,
        "torch": torch.__version__,
    }
    return out, 0 if finite else 1


if __name__ == "__main__":
    sys.exit(json_stdout.run(main))
