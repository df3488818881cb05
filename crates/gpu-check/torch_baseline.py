#!/usr/bin/env python3
"""Second baseline for `gpu_check`'s timings: the unfused sequence written with torch ops
on the device machine's PyTorch (domain.md section 8: PyTorch is `python3` there).

W virtual ranks live in one [W, T, H] tensor on one GPU, as in gpu_check. One call is
what each rank does after a row-parallel GEMM: all-reduce (sum over ranks in fp32, one
rounding to the activation dtype, broadcast to every rank), residual add, RMSNorm (one
rounding), and optionally dynamic per-token FP8 quant. The sequence is captured `--calls`
times in one CUDA graph and the graph replayed 20 times; the median time per call is
printed in the same units as gpu_check's table (microseconds per call).

Usage (on the GPU machine, from the repository root):
    python3 crates/gpu-check/torch_baseline.py [--world 8] [--hidden 4096]
        [--tokens 1 7 16 40 42 128 1024] [--calls 50] [--quant none fp8tok]
`--device cpu` runs one eager call per case (a smoke test of the script, no timing).
"""

import argparse
import statistics
import sys


def step(x, residual, gamma, eps, quant, torch):
    """One unfused call on all W virtual ranks. x, residual: [W, T, H]; gamma: [H]."""
    a = x.float().sum(dim=0).to(x.dtype)  # all-reduce: fp32 sum, one rounding
    h = (a.unsqueeze(0).float() + residual.float()).to(x.dtype)  # every rank adds its residual
    hf = h.float()
    r = torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = (hf * r * gamma.float()).to(x.dtype)  # one rounding, as the contract
    if quant == "fp8tok":
        amax = y.float().abs().amax(dim=-1, keepdim=True)
        scale = torch.clamp(amax / 448.0, min=1.0 / (512.0 * 448.0))
        q = torch.clamp(y.float() / scale, -448.0, 448.0).to(torch.float8_e4m3fn)
        return h, y, q, scale
    return h, y


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 7, 16, 40, 42, 128, 1024])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--quant", nargs="+", default=["none", "fp8tok"], choices=["none", "fp8tok"])
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch_baseline: PyTorch is not installed; no torch baseline", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("torch_baseline: no CUDA device visible to PyTorch", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    print(
        f"torch {torch.__version__}: unfused torch ops, W = {args.world}, H = {args.hidden}, bf16, "
        f"per call replayed from a CUDA graph of {args.calls} calls (median of 20)"
    )
    print(f"{'pattern':<18} {'T':>5} {'torch us':>9}")
    for quant in args.quant:
        name = "res_norm" if quant == "none" else "res_norm_fp8tok"
        for t in args.tokens:
            g = torch.Generator(device="cpu").manual_seed(t)
            shape = (args.world, t, args.hidden)
            x = (torch.rand(shape, generator=g) * 4 - 2).to(torch.bfloat16).to(dev)
            res = (torch.rand(shape, generator=g) * 4 - 2).to(torch.bfloat16).to(dev)
            gamma = (torch.rand((args.hidden,), generator=g) * 4 - 2).to(torch.bfloat16).to(dev)
            if args.device != "cuda":
                out = step(x, res, gamma, 1e-6, quant, torch)
                assert out[1].shape == shape and torch.isfinite(out[1].float()).all()
                print(f"{name:<18} {t:>5} {'(cpu smoke, not timed)':>9}")
                continue
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):  # warm-up outside capture (allocator, kernels)
                    step(x, res, gamma, 1e-6, quant, torch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.calls):
                    step(x, res, gamma, 1e-6, quant, torch)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(20):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1000.0 / args.calls)
            print(f"{name:<18} {t:>5} {statistics.median(times):>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
