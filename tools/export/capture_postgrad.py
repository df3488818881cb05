"""Post-grad FX graphs from torch.compile, as a serving engine's compiler pass sees them.

Each model (hf_models.build, one TP rank, random weights on the CPU) runs under
torch.compile (inductor) on every rank of a gloo process group (world size 2, spawned
with torch.multiprocessing; the all-reduces are the functional collectives of that
group). Two custom post-grad passes serialize the graph with fx_json: one in
`post_grad_custom_pre_pass` (inductor's decompositions applied, before its own post-grad
passes) and one in `post_grad_custom_post_pass` (after them, where vLLM's and SGLang's
passes run); the second one then stops the compilation (nothing needs to run). Rank 0
writes OUT/<stem>_L<layers>_tp2[_<spelling>]_postgrad_<pre|post>.json.gz (the post
graph only when inductor's own passes changed it).

    python tools/export/capture_postgrad.py --configs ir-fixtures/configs --out ir-fixtures/postgrad

Floats are specialised (`torch._dynamo.config.specialize_float = True`), as a serving
engine's compile does for a model's constants: with torch 2.15's default every Python
float attribute (an RMSNorm eps) becomes an f64 graph input, which the importer
refuses (no f64 in arfuse's IR). The token dim is dynamic, T in 2..8192.
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fx_json  # noqa: E402
import hf_models  # noqa: E402

WORLD = 2
# (config file, layers, all-reduce spelling, hf_models.spelled_all_reduce): Llama
# (two-rounding norm), gpt-oss (bf16 weight times f32 activations, MoE), Gemma-3
# (offset weight, sandwich norms), Qwen3 MoE (per-head q/k norms that are not sites),
# and Llama calling torch.distributed.all_reduce in place (what dynamo and AOT autograd
# make of it). `_c10d_functional.all_reduce_` in model code is not captured: AOT
# autograd refuses to functionalize it ("a custom (non-ATen) operator whose output has
# alias annotations"); torch.export keeps it (export_spellings.py).
MODELS = [
    ("meta-llama__Llama-3.1-8B-Instruct.json", 2, "functional"),
    ("openai__gpt-oss-120b.json", 2, "functional"),
    ("google__gemma-3-1b-it.json", 2, "functional"),
    ("Qwen__Qwen3-30B-A3B.json", 2, "functional"),
    ("meta-llama__Llama-3.1-8B-Instruct.json", 2, "dist_all_reduce"),
]


class StopCompile(Exception):
    """Raised by the last pass: the graphs are written, nothing needs to run."""


def run(rank: int, args, port: int):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    warnings.filterwarnings("ignore")
    import transformers
    import torch._inductor.config as ic
    from torch._inductor.compile_fx import compile_fx

    transformers.logging.set_verbosity_error()
    torch._dynamo.config.specialize_float = True
    ic.fx_graph_cache = False
    group = dist.group.WORLD.group_name
    for config, layers, spelling in MODELS:
        path = os.path.join(args.configs, config)
        stem = hf_models.stem_of(path)
        torch.manual_seed(0)
        model, cfg, _ = hf_models.build(
            path, layers, WORLD, hf_models.spelled_all_reduce(spelling, group), device="cpu"
        )
        tag = "" if spelling == "functional" else f"_{spelling}"
        names: dict = {}

        def backend(gm, example_inputs):
            # The dynamo graph's placeholders, in order, with the parameter each holds.
            order = []
            for n in gm.graph.nodes:
                if n.op != "placeholder":
                    continue
                src = getattr(n.meta.get("grapharg"), "source", None)
                name = getattr(src, "name", None) if src is not None else None
                name = name() if callable(name) else name
                order.append(fx_json.parameter_fqn(name) if isinstance(name, str) else None)
            names["order"] = order
            return compile_fx(gm, example_inputs)

        def save(stage):
            def pass_(graph):
                gm = graph.owning_module
                placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
                order = names.get("order", [])
                params = {}
                if len(order) == len(placeholders):
                    for n, fqn in zip(placeholders, order):
                        if fqn:
                            params[n.name] = fqn
                if rank == 0:
                    data = fx_json.serialize(gm, params, stage)
                    # Written once when inductor's own post-grad passes changed nothing.
                    same = stage == "post" and data == names.get("pre", b"").replace(
                        b'"stage":"pre"', b'"stage":"post"'
                    )
                    names[stage] = data
                    name = f"{stem}_L{layers}_tp{WORLD}{tag}_postgrad_{stage}.json.gz"
                    out = os.path.join(args.out, name)
                    if same:
                        print(f"{name}: identical to the pre pass graph, not written", flush=True)
                    else:
                        with gzip.GzipFile(out, "wb", mtime=0) as f:
                            f.write(data)
                        print(f"{out}: {len(data)} bytes JSON, {os.path.getsize(out)} gzipped", flush=True)
                if stage == "post":
                    raise StopCompile()

            return pass_

        ic.post_grad_custom_pre_pass = save("pre")
        ic.post_grad_custom_post_pass = save("post")
        ids = torch.zeros(1, 16, dtype=torch.long)
        torch._dynamo.mark_dynamic(ids, 1, min=2, max=8192)
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                torch.compile(model, backend=backend, fullgraph=True)(ids)
        except Exception as e:  # noqa: BLE001 - the expected stop, or a real failure
            if "StopCompile" not in repr(e) and "StopCompile" not in str(type(e)):
                raise
        del model
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=29531)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    mp.spawn(run, args=(args, args.port), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
