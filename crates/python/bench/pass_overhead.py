"""Benchmark (not a test): the time arfuse.torch.FusionPass takes inside torch.compile,
next to inductor's whole post-grad stage and the whole compilation, for a 32-layer
Hugging Face Llama (one tensor-parallel rank, the shapes of crates/python/tests).

    python crates/python/bench/pass_overhead.py [--layers 32] [--world 2] [--tokens 16]

One process: the all-reduces are functional collectives of a one-rank gloo group (the
graph is the one a rank of a `--world` group compiles; the pass is planned for the
h200-sxm-x<world> preset). Measured per compilation:

- the pass: serialize (arfuse.fx_json), import + lower + splice (Rust), rewrite the FX
  graph (Python), each in seconds (the real FusionPass, its steps wrapped with timers);
- inductor's post-grad stage (`_recursive_post_grad_passes`, which includes the pass),
  from torch._dynamo.utils.compilation_time_metrics;
- the first call of the compiled model (dynamo, AOT autograd, inductor, C++ compile,
  one run), wall clock, with a cold inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR).

Prints one table; `--json` also writes the figures.
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="arfuse-bench-"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import arfuse  # noqa: E402
import arfuse.torch as at  # noqa: E402
import gloo_worker  # noqa: E402


def timed_pass(target):
    """The real FusionPass, with its three steps timed: the serializer, the Rust call and
    the FX rewrite are wrapped where arfuse.torch looks them up."""
    times = {"serialize_s": 0.0, "rust_s": 0.0, "fx_rewrite_s": 0.0, "calls": 0}

    def timing(key, fn):
        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[key] += time.perf_counter() - t

        return wrapped

    serialize, fx_lower, apply_splice = at.fx_json.serialize, at._arfuse._fx_lower, at.apply_splice

    def serialize_and_count(gm, *a):
        data = serialize(gm, *a)
        times["json_bytes"] = len(data)
        times["graph_nodes_before"] = len(gm.graph.nodes)
        times["calls"] += 1
        return data

    def splice_and_count(graph, splice):
        left = apply_splice(graph, splice)
        times["graph_nodes_after"] = len(graph.nodes)
        times["left_unfused"] = left
        return left

    at.fx_json.serialize = timing("serialize_s", serialize_and_count)
    at._arfuse._fx_lower = timing("rust_s", fx_lower)
    at.apply_splice = timing("fx_rewrite_s", splice_and_count)
    return at.FusionPass(target), times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
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

    fusion, times = timed_pass(arfuse.Target.preset(f"h200-sxm-x{args.world}"))
    torch._inductor.config.post_grad_custom_post_pass = fusion
    metrics = torch._dynamo.utils.compilation_time_metrics
    metrics.clear()
    t0 = time.perf_counter()
    with torch.no_grad():
        torch.compile(model, fullgraph=True)(ids)
    first_call = time.perf_counter() - t0
    post_grad = sum(metrics.get("_recursive_post_grad_passes", []))
    report = fusion.reports[0]
    # The rest of FusionPass.__call__ (json parsing of the report, graph.lint) is not
    # counted; it is part of inductor's post-grad total below.
    ours = times["serialize_s"] + times["rust_s"] + times["fx_rewrite_s"]
    fig = {
        "layers": args.layers,
        "sites_fused": report["all_reduces_fused"],
        "sites_seen": report["all_reduces_seen"],
        "pass_calls": times["calls"],
        "post_grad_graph_nodes_before": times["graph_nodes_before"],
        "post_grad_graph_nodes_after": times["graph_nodes_after"],
        "fx_json_bytes": times["json_bytes"],
        "pass_serialize_s": round(times["serialize_s"], 3),
        "pass_import_lower_splice_rust_s": round(times["rust_s"], 3),
        "pass_fx_rewrite_s": round(times["fx_rewrite_s"], 3),
        "pass_total_s": round(ours, 3),
        "inductor_post_grad_total_s": round(post_grad, 3),
        "inductor_post_grad_without_pass_s": round(post_grad - ours, 3),
        "first_call_s": round(first_call, 2),
        "e_graph_iterations": report["runner"]["iterations"],
        "left_unfused": times["left_unfused"],
        "arfuse_extension": arfuse._arfuse.__file__,
        "torch": torch.__version__,
    }
    width = max(len(k) for k in fig)
    for k, v in fig.items():
        print(f"{k:<{width}}  {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
