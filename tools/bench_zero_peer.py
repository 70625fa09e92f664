#!/usr/bin/env python3
# bench_zero_peer.py — the PyTorch peer that tools/bench_zero.cpp (bench-zero) is compared against.
#
# The same job as bench-zero's default: the MLP 784 -> 4096 x 7 -> 10 (about 104M parameters),
# seeded synthetic samples of 784 features and 10 classes, global batch 16, cross entropy,
# Adam lr 1e-4, one thread per rank, on CPU with gloo. Modes:
#   ddp    DistributedDataParallel + torch.optim.Adam                        (the stage-0 peer)
#   zero1  DistributedDataParallel + ZeroRedundancyOptimizer(Adam)           (the stage-1 peer)
#
#   MALLOC_MMAP_THRESHOLD_=2147483647 MALLOC_TRIM_THRESHOLD_=4294967295 MALLOC_TOP_PAD_=536870912 \
#   OMP_NUM_THREADS=1 torchrun --redirects 2 --tee 2 --standalone --nproc_per_node 2 \
#   tools/bench_zero_peer.py --mode zero1
#
# (--redirects 2 --tee 2 only route the ranks' stderr through torchrun: Debian's torch 1.13 under
# Python 3.11 cannot parse torchrun's default "0" for either, and fails before starting a rank.)
#
# Run it with the allocator settings tetra applies to itself (the MALLOC_* variables above): tetra
# keeps big blocks for reuse (Note [Big blocks] in core/allocator.h); without them glibc maps and
# unmaps each large tensor and PyTorch measures glibc, not itself. tools/bench_zero_vs_peer.sh
# runs it beside bench-zero.
#
# Rank 0 prints one line of JSON to stdout: samples/s for the whole job (timed steps x global
# batch / wall seconds between two barriers), ms per step, and the peak RSS of every rank.
import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args():
    p = argparse.ArgumentParser(description="PyTorch DDP / ZeRO-1 peer of tetra's bench-zero")
    p.add_argument("--mode", choices=["ddp", "zero1"], default="zero1")
    p.add_argument("--hidden", type=int, default=4096, help="width of the hidden layers")
    p.add_argument("--layers", type=int, default=7, help="number of hidden Linear layers")
    p.add_argument("--batch", type=int, default=16, help="global batch, split evenly over ranks")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-view", action="store_true", help="DDP gradient_as_bucket_view=True")
    p.add_argument("--zero-bucket-view", action="store_true",
                   help="ZeroRedundancyOptimizer parameters_as_bucket_view=True (one broadcast per rank's bucket)")
    return p.parse_args()


def mlp(features, hidden, layers, classes):
    mods, width = [], features
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    mods.append(nn.Linear(width, classes))
    return nn.Sequential(*mods)


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} does not split evenly over {world} ranks")
    local = args.batch // world
    torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP broadcasts rank 0's anyway)
    model = DDP(mlp(784, args.hidden, args.layers, 10), gradient_as_bucket_view=args.bucket_view)
    params = sum(p.numel() for p in model.parameters())
    adam = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    if args.mode == "ddp":
        opt = torch.optim.Adam(model.parameters(), **adam)
    else:  # overlap_with_ddp left at its default (False)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      parameters_as_bucket_view=args.zero_bucket_view, **adam)
    loss_fn = nn.CrossEntropyLoss()

    # Every step's data made up front, so that generating it is not timed; each rank its own shard.
    g = torch.Generator().manual_seed(args.seed * 1000003 + rank + 1)
    n = args.warmup + args.steps
    xs = torch.randn(n, local, 784, generator=g)
    ys = torch.randint(0, 10, (n, local), generator=g, dtype=torch.int64)

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(xs[i]), ys[i]).backward()
        opt.step()

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.warmup, n):
        step(i)
    dist.barrier()
    wall = time.perf_counter() - t0

    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    all_rss = [torch.zeros_like(rss) for _ in range(world)]
    dist.all_gather(all_rss, rss)
    if rank == 0:
        print(json.dumps({
            "peer": "pytorch", "torch": torch.__version__, "mode": args.mode, "world": world,
            "threads": args.threads, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
            "hidden": args.hidden, "layers": args.layers, "bucket_view": args.bucket_view,
            "zero_bucket_view": args.zero_bucket_view,
            "samples_per_s": round(args.steps * args.batch / wall, 3),
            "step_ms": round(wall / args.steps * 1e3, 3),
            "peak_rss_bytes": [int(t.item()) for t in all_rss], "params": params,
        }, separators=(",", ":")), flush=True)
    # Leave without tearing the process group down: PyTorch 1.13's gloo group can deadlock in its
    # destructor (its worker thread waits for the GIL the joining thread holds), seen here as a
    # rank that printed its result and never exited.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
