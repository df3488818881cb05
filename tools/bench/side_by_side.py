"""arfuse against torch inductor's pattern matcher, on the same L-layer model.

For each size L, one dense tensor-parallel stack (2L + 1 all-reduce sites: the first
all-reduce -> RMSNorm, then per layer two all-reduce -> residual add -> RMSNorm, the
norm decomposed as Hugging Face's Llama writes it) is traced once to an FX graph
(make_fx with inductor's decompositions, fake tensors, `torch.ops._c10d_functional.all_reduce` + `wait_tensor`: no
process group is needed). Then, in one run:

- inductor: a `PatternMatcherPass` with the two replacements registered the way vLLM's
  AllReduceFusionPass registers its patterns (`register_replacement(pattern,
  replacement, example_inputs, fwd_only, pass)`; the replacement calls one custom op,
  as vLLM's calls FlashInfer's fused all-reduce) is applied to a fresh copy of the
  graph; the time of `apply` is taken (best of `--runs` copies, fewer once the applies
  of a size have taken `--budget` seconds, `make_fx` and the copies not counted: one
  `apply` on the 4,096-layer stack takes minutes, so with the defaults the largest
  sizes' figures are one apply each, against arfuse's best of many; the table says
  how many runs each side's figure is the best of).
- arfuse: the same FX graph is serialized with `tools/export/fx_json.py`
  (docs/fx-graph-format.md) and lowered by the `lower_time` example
  (`cargo run --release --example lower_time`), which imports it once and times
  `arfuse::lower` alone (best of `--arfuse-runs` lowerings in that one process).

Both sides must find every site (the script checks the count); it prints, per size,
both times per site and the ratio. Times depend on the machine's load: the load
average is printed before and after.

Run (CPU torch): `python tools/bench/side_by_side.py
[--sizes 8,32,128,512,1024,2048,4096] [--runs 3] [--budget 60] [--arfuse-runs 20]`
(the defaults; all sizes took 21 minutes on this project's 2-core VM, nearly all of
it inductor's and make_fx's).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._inductor.pattern_matcher import (
    PatternMatcherPass,
    fwd_only,
    register_replacement,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "export"))
import fx_json  # noqa: E402

GROUP = "tp"
EPS = 1e-5
HIDDEN = 4096
TOKENS = 64
DTYPE = torch.bfloat16


def all_reduce(x):
    y = torch.ops._c10d_functional.all_reduce(x, "sum", GROUP)
    return torch.ops._c10d_functional.wait_tensor(y)


def rms_norm(x, w):
    """Hugging Face Llama's RMSNorm, decomposed (rounds twice)."""
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + EPS)
    return w * h.to(x.dtype)


def model(layers: int):
    """The stack as a function of (x, weights): attention and MLP are one matmul each
    (their output is what the all-reduce reduces)."""

    def f(x, w_norm, w_attn, w_mlp):
        r = all_reduce(x)
        n = rms_norm(r, w_norm)
        for _ in range(layers):
            a = all_reduce(torch.mm(n, w_attn))
            r = a + r
            n = rms_norm(r, w_norm)
            m = all_reduce(torch.mm(n, w_mlp))
            r = m + r
            n = rms_norm(r, w_norm)
        return n

    return f


def example_inputs():
    return [
        torch.empty(TOKENS, HIDDEN, dtype=DTYPE),
        torch.empty(HIDDEN, dtype=DTYPE),
        torch.empty(HIDDEN, HIDDEN, dtype=DTYPE),
        torch.empty(HIDDEN, HIDDEN, dtype=DTYPE),
    ]


def trace(layers: int) -> torch.fx.GraphModule:
    """The model's graph with inductor's decompositions, as a post-grad pass sees it
    (and as `fwd_only` traces the patterns: casts are `prims.convert_element_type`)."""
    from torch._inductor.decomposition import select_decomp_table

    return make_fx(
        model(layers), decomposition_table=select_decomp_table(), tracing_mode="fake"
    )(*example_inputs())


# The fused op the replacements call (a stand-in for FlashInfer's fused all-reduce:
# only its schema and fake kernel matter to the pattern matcher).
@torch.library.custom_op("arfuse_bench::allreduce_add_rms_norm", mutates_args=())
def allreduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError("never run: the benchmark only rewrites graphs")


@allreduce_add_rms_norm.register_fake
def _(x, residual, w):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("arfuse_bench::allreduce_rms_norm", mutates_args=())
def allreduce_rms_norm(
    x: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError("never run: the benchmark only rewrites graphs")


@allreduce_rms_norm.register_fake
def _(x, w):
    return torch.empty_like(x), torch.empty_like(x)


def inductor_pass() -> PatternMatcherPass:
    """The two patterns, registered as vLLM's AllReduceFusionPass registers its own:
    all-reduce -> residual add -> RMSNorm (returning norm and residual) and all-reduce
    -> RMSNorm."""
    pm = PatternMatcherPass(pass_name="arfuse_bench_allreduce_fusion")
    # Meta tensors: tracing the patterns runs the all-reduce's meta kernel, so no
    # process group is needed (the matcher compares ops and structure, not devices).
    x = torch.empty(TOKENS, HIDDEN, dtype=DTYPE, device="meta")
    r = torch.empty(TOKENS, HIDDEN, dtype=DTYPE, device="meta")
    w = torch.empty(HIDDEN, dtype=DTYPE, device="meta")

    def residual_pattern(x, r, w):
        s = all_reduce(x) + r
        return rms_norm(s, w), s

    def residual_replacement(x, r, w):
        out = torch.ops.arfuse_bench.allreduce_add_rms_norm.default(x, r, w)
        return out[0], out[1]

    def first_pattern(x, w):
        s = all_reduce(x)
        return rms_norm(s, w), s

    def first_replacement(x, w):
        out = torch.ops.arfuse_bench.allreduce_rms_norm.default(x, w)
        return out[0], out[1]

    register_replacement(residual_pattern, residual_replacement, [x, r, w], fwd_only, pm)
    register_replacement(first_pattern, first_replacement, [x, w], fwd_only, pm)
    return pm


def inductor_time(
    gm: torch.fx.GraphModule, pm: PatternMatcherPass, runs: int, budget: float
):
    """The fastest `apply` of up to `runs` (1 or more) fresh copies of `gm`, and how
    many copies ran: after the first, no further copy starts once the applies so far
    have taken `budget` seconds in all."""
    best = float("inf")
    count = 0
    spent = 0.0
    done = 0
    while done < runs and (done == 0 or spent < budget):
        g = copy.deepcopy(gm)
        t = time.perf_counter()
        count = pm.apply(g.graph)
        took = time.perf_counter() - t
        best = min(best, took)
        spent += took
        done += 1
    return best, count, done


def arfuse_time(gm: torch.fx.GraphModule, runs: int, exe: str):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        f.write(fx_json.serialize(gm, {}, stage="side_by_side"))
        path = f.name
    try:
        out = subprocess.run(
            [exe, path, "h200-sxm-x8", str(runs)],
            capture_output=True,
            text=True,
        )
    finally:
        os.unlink(path)
    if out.returncode != 0:
        raise SystemExit(f"lower_time failed (exit {out.returncode}): {out.stderr.strip()}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["best_s"], res["fused"], res["nodes"], res["runs"]


def lower_time_exe() -> str:
    """Builds the `lower_time` example (release) and returns its path. Cargo runs in
    the repository root, so a relative `CARGO_TARGET_DIR` is taken from there."""
    print("# building the lower_time example (cargo build --release)", file=sys.stderr)
    subprocess.run(
        ["cargo", "build", "--release", "--quiet", "--example", "lower_time"],
        cwd=ROOT,
        check=True,
    )
    target = os.path.join(ROOT, os.environ.get("CARGO_TARGET_DIR", "target"))
    return os.path.join(target, "release", "examples", "lower_time")


def load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return "load average " + " ".join(f.read().split()[:3])
    except OSError:
        return "load average unknown"


def positive(text: str) -> int:
    """A count of 1 or more, for argparse."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not 1 or more")
    return n


def layer_counts(text: str) -> list[int]:
    """Comma-separated layer counts, each 1 or more, at least one, for argparse."""
    sizes = [positive(s.strip()) for s in text.split(",") if s.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError("no layer count given")
    return sizes


def seconds(text: str) -> float:
    """A finite number of seconds, 0 or more, for argparse."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a finite number, 0 or more")
    return x


def ratio(inductor_us, arfuse_us):
    """Inductor's time over arfuse's, as `NNNx` from 10x up and with two decimals
    below (`0.45x` where inductor is faster)."""
    r = inductor_us / arfuse_us
    return f"{r:.0f}x" if r >= 10 else f"{r:.2f}x"


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="With the defaults the run took 21 minutes on this project's 2-core VM; "
        "pass fewer --sizes for a quick look.",
    )
    ap.add_argument(
        "--sizes",
        type=layer_counts,
        default="8,32,128,512,1024,2048,4096",
        help="layer counts, comma-separated, each 1 or more",
    )
    ap.add_argument(
        "--runs",
        type=positive,
        default=3,
        help="inductor: best of this many copies (fewer past --budget)",
    )
    ap.add_argument(
        "--arfuse-runs", type=positive, default=20, help="arfuse: best of this many lowerings"
    )
    ap.add_argument(
        "--budget",
        type=seconds,
        default=60.0,
        help="seconds of inductor applies per size after which no further copy starts",
    )
    args = ap.parse_args()
    exe = lower_time_exe()
    pm = inductor_pass()
    print(f"# before: {load_average()}; torch {torch.__version__}")
    print(
        "| layers | sites | FX nodes | IR nodes | inductor us/site (runs) "
        "| arfuse us/site (runs) | ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for layers in args.sizes:
        sites = 2 * layers + 1
        gm = trace(layers)
        fx_nodes = len(gm.graph.nodes)
        t_ind, n_ind, ind_runs = inductor_time(gm, pm, args.runs, args.budget)
        t_arf, n_arf, ir_nodes, arf_runs = arfuse_time(gm, args.arfuse_runs, exe)
        if n_ind != sites or n_arf != sites:
            raise SystemExit(
                f"L={layers}: expected {sites} sites, inductor replaced {n_ind}, "
                f"arfuse fused {n_arf}"
            )
        ui, ua = t_ind * 1e6 / sites, t_arf * 1e6 / sites
        print(
            f"| {layers} | {sites} | {fx_nodes} | {ir_nodes} | {ui:.1f} ({ind_runs}) "
            f"| {ua:.1f} ({arf_runs}) | {ratio(ui, ua)} |",
            flush=True,
        )
    print(f"# after: {load_average()}")


if __name__ == "__main__":
    main()
