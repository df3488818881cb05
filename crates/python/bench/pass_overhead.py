"""Benchmark (not a test): what arfuse.torch.FusionPass costs inside torch.compile, side
by side with inductor's pattern matcher registered and applied the way vLLM's
AllReduceFusionPass does it, on the same post-grad graph of a 32-layer Hugging Face Llama
(one tensor-parallel rank, the shapes of crates/python/tests).

    python crates/python/bench/pass_overhead.py [--layers 32] [--world 2] [--tokens 16]
                                                [--reps 7] [--json FILE]

One process: the all-reduces are functional collectives of a one-rank gloo group (the
graph is the one a rank of a `--world` group compiles; the pass is planned for the
h200-sxm-x<world> preset). The model is compiled once; inductor's post-grad custom pass
receives its graph, copies it (`--reps` copies per contender) and times, alternating:

- arfuse: the whole FusionPass (walk the FX graph, import, lower, splice, rewrite the
  FX graph), with its two halves timed as well: the Rust call `_fx_lower_graph` (walk +
  import + lower + splice) and the FX rewrite (`apply_splice`);
- the pattern matcher: `torch._inductor.pattern_matcher.PatternMatcherPass.apply` with
  the patterns vLLM 0.32's AllReduceFusionPass registers (`register_replacement` with
  `fwd_only` traces, per epsilon in (1e-5, 1e-6): all-reduce -> RMSNorm returning
  both; all-reduce -> residual add -> RMSNorm returning both, and returning the norm
  only), written for this graph's spellings (the functional all-reduce and wait, the
  Hugging Face RMSNorm decomposed), replaced by arfuse's fused op so that both
  contenders produce the same graph. Registration is timed apart (vLLM does it once when
  its pass is built).

Both contenders must fuse the same number of sites; the script fails otherwise. The
real graph is then compiled with arfuse's rewrite. Prints one table (medians, and the
first of each); `--json` also writes the figures.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="arfuse-bench-"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch._inductor.pattern_matcher as pm  # noqa: E402

import arfuse  # noqa: E402
import arfuse.torch as at  # noqa: E402
import gloo_worker  # noqa: E402

FUSED = "arfuse.fused_allreduce_rms_norm"


def register_vllm_style(group: str, dtype: torch.dtype) -> pm.PatternMatcherPass:
    """The patterns of vLLM's AllReduceFusionPass.register_patterns (AllReduceRMSNorm,
    AllReduceFusedAddRMSNorm and its norm-only form, per epsilon), for this graph."""
    patterns = pm.PatternMatcherPass(pass_name="bench_all_reduce_fusion")

    def all_reduce(x):
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group))

    def hf_rms_norm(x, weight, eps):
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + eps)
        return weight * h.to(x.dtype)

    def fused(x, residual, weight, eps):
        return torch.ops.arfuse.fused_allreduce_rms_norm(x, residual, weight, group, eps, 0.0, True, False, "none")

    def empty(*shape):
        return torch.empty(*shape, dtype=dtype)

    def for_eps(eps):
        """The three (pattern, replacement, example inputs) of one epsilon (a function
        of its own: the pattern matcher traces the search function again when it checks
        a match's constants, so each closure must keep its own eps)."""

        def norm_pattern(x, weight):
            a = all_reduce(x)
            return hf_rms_norm(a, weight, eps), a

        def norm_replacement(x, weight):
            out = fused(x, None, weight, eps)
            return out[0], out[1]

        def add_pattern(residual, x, weight):
            h = residual + all_reduce(x)
            return hf_rms_norm(h, weight, eps), h

        def add_replacement(residual, x, weight):
            out = fused(x, residual, weight, eps)
            return out[0], out[1]

        def add_norm_only_pattern(residual, x, weight):
            return add_pattern(residual, x, weight)[0]

        def add_norm_only_replacement(residual, x, weight):
            return add_replacement(residual, x, weight)[0]

        two = [empty(5, 16), empty(16)]
        three = [empty(5, 16), empty(5, 16), empty(16)]
        return (
            (norm_pattern, norm_replacement, two),
            (add_pattern, add_replacement, three),
            # The norm only: the last site of a graph, whose residual is not read.
            (add_norm_only_pattern, add_norm_only_replacement, three),
        )

    for eps in (1e-5, 1e-6):
        for pattern, replacement, inputs in for_eps(eps):
            pm.register_replacement(pattern, replacement, inputs, pm.fwd_only, patterns)
        # vLLM clears this between epsilons so that the second one registers too.
        pm._seen_patterns.clear()
    return patterns


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of `graph` (nodes and their meta) in a GraphModule sharing the original's
    attributes."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(graph, {}))
    return torch.fx.GraphModule(graph.owning_module, g).graph


def fused_calls(graph: torch.fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and FUSED in str(n.target))


class SideBySide(torch._inductor.custom_graph_pass.CustomGraphPass):
    def __init__(self, target, patterns, reps):
        self.fusion = at.FusionPass(target)
        self.patterns = patterns
        self.reps = reps
        self.times = {"arfuse": [], "rust": [], "fx_rewrite": [], "pattern_matcher": []}
        self.fig = {}

    def uuid(self):
        return f"bench-{time.time()}"

    def _arfuse(self, graph):
        rust = at._arfuse._fx_lower_graph
        splice = at.apply_splice
        part = {}

        def timed(key, fn):
            def w(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    part[key] = time.perf_counter() - t

            return w

        at._arfuse._fx_lower_graph = timed("rust", rust)
        at.apply_splice = timed("fx_rewrite", splice)
        try:
            t = time.perf_counter()
            self.fusion(graph)
            total = time.perf_counter() - t
        finally:
            at._arfuse._fx_lower_graph = rust
            at.apply_splice = splice
        if self.fusion.errors:
            raise RuntimeError(f"arfuse failed: {self.fusion.errors}")
        self.times["arfuse"].append(total)
        self.times["rust"].append(part["rust"])
        self.times["fx_rewrite"].append(part["fx_rewrite"])
        return fused_calls(graph)

    def _pattern_matcher(self, graph):
        t = time.perf_counter()
        count = self.patterns.apply(graph)
        self.times["pattern_matcher"].append(time.perf_counter() - t)
        graph.eliminate_dead_code()
        return count, fused_calls(graph)

    def __call__(self, graph):
        self.fig["post_grad_graph_nodes"] = len(graph.nodes)
        copies = [(copy_graph(graph), copy_graph(graph)) for _ in range(self.reps)]
        for a, b in copies:
            fused_a = self._arfuse(a)
            matched, fused_b = self._pattern_matcher(b)
            if fused_a != fused_b or matched != fused_b:
                raise RuntimeError(f"arfuse fused {fused_a} sites, the pattern matcher {matched} ({fused_b} calls)")
        self.fig["sites_fused_each"] = fused_a
        self.fig["graph_nodes_after_arfuse"] = len(a.nodes)
        self.fig["graph_nodes_after_pattern_matcher"] = len(b.nodes)
        self.fusion(graph)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch._dynamo.config.specialize_float = True
    torch._inductor.config.compile_threads = 1
    import transformers

    transformers.logging.set_verbosity_error()
    gloo_worker.LAYERS = args.layers
    group = dist.group.WORLD.group_name
    model, cfg = gloo_worker.build(args.world, 0, group, fp8=False)
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    torch._dynamo.mark_dynamic(ids, 1, min=2, max=8192)

    t = time.perf_counter()
    patterns = register_vllm_style(group, torch.bfloat16)
    registration = time.perf_counter() - t
    bench = SideBySide(arfuse.Target.preset(f"h200-sxm-x{args.world}"), patterns, args.reps)
    torch._inductor.config.post_grad_custom_post_pass = bench
    with torch.no_grad():
        torch.compile(model, fullgraph=True)(ids)

    sites = bench.fig["sites_fused_each"]
    fig = {"layers": args.layers, **bench.fig, "reps": args.reps}
    for key, xs in bench.times.items():
        fig[f"{key}_first_ms"] = round(xs[0] * 1e3, 1)
        fig[f"{key}_median_ms"] = round(statistics.median(xs) * 1e3, 1)
    for key in ("arfuse", "pattern_matcher"):
        fig[f"{key}_median_ms_per_site"] = round(statistics.median(bench.times[key]) * 1e3 / sites, 2)
    fig["pattern_registration_ms"] = round(registration * 1e3, 1)
    fig["torch"] = torch.__version__
    width = max(len(k) for k in fig)
    for k, v in fig.items():
        print(f"{k:<{width}}  {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
