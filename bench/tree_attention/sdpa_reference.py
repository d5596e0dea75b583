#!/usr/bin/env python3
"""Reference timings for the wide part of the few-shot trees: the shared prompt's attention for
all of a tree's query rows, as PyTorch's fused attention kernels run it (cuDNN, FlashAttention-2,
memory-efficient), on the GPU machine (PyTorch comes with it; no gRPC needed).

The wide part of few-shot P + b x S at GQA g, per kv head: b * g query rows against P prompt
tokens. Run as SDPA over C chunks of the prompt (batch = chunks, heads = kv heads, the query rows
as the sequence: GQA folded into rows as the tree kernel does), it is the same QK and PV work
as the tree kernel's wide items, without the merge of the chunks' partials. Each case is timed
for every chunk count given, L2 flushed before each repetition, median of --reps.

usage: sdpa_reference.py [--reps N] [--case P,ROWS,KVHEADS,CHUNKS]...
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_us(fn, reps, flush):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(reps + 3):
        flush.add_(1)  # 256 MB written: L2 holds nothing of the operands
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        if i >= 3:
            out.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--case", action="append", default=[])
    a = ap.parse_args()
    cases = a.case or ["16000,256,8,1", "16000,256,8,8", "16000,256,8,16", "4000,200,8,1",
                       "4000,200,8,5", "4000,200,8,8", "4000,200,32,5"]
    dev = torch.cuda.get_device_properties(0)
    print(f"device: {dev.name}, {dev.multi_processor_count} SMs; torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    # Copy bandwidth (read + write) as bench_tree_attention measures it.
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    cp_us = time_us(lambda: dst.copy_(src), 20, flush)
    copy_tbps = 2 * src.numel() / cp_us / 1e6
    print(f"d2d copy bandwidth {copy_tbps:.3f} TB/s (read + write)")
    print(f"{'case':36s} {'backend':10s} {'us':>8s} {'TFLOP/s':>8s} {'uniqKV TB/s':>11s} {'%cp':>4s}")
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash2", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    for c in cases:
        p, rows, kvh, chunks = (int(x) for x in c.split(","))
        per = -(-p // chunks)
        q = torch.randn(chunks, kvh, rows, 128, dtype=torch.float16, device="cuda")
        k = torch.randn(chunks, kvh, per, 128, dtype=torch.float16, device="cuda")
        v = torch.randn(chunks, kvh, per, 128, dtype=torch.float16, device="cuda")
        flops = 4.0 * chunks * kvh * rows * per * 128
        kv_bytes = 2 * chunks * kvh * per * 128 * 2
        name = f"P={p} rows={rows} kvh={kvh} chunks={chunks}"
        for bname, b in backends:
            try:
                with sdpa_kernel([b]):
                    F.scaled_dot_product_attention(q, k, v)
                    torch.cuda.synchronize()
                    us = time_us(lambda: F.scaled_dot_product_attention(q, k, v), a.reps, flush)
            except RuntimeError as e:
                print(f"{name:36s} {bname:10s} unavailable: {str(e).splitlines()[0][:80]}")
                continue
            tbps = kv_bytes / us / 1e6
            print(f"{name:36s} {bname:10s} {us:8.2f} {flops / us / 1e6:8.1f} {tbps:11.2f} "
                  f"{100 * tbps / copy_tbps:4.0f}")


if __name__ == "__main__":
    main()
