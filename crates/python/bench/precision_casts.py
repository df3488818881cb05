"""Measurement (not a test): how many output elements of the compiled gloo test model
differ from eager, with and without `torch._inductor.config.emulate_precision_casts`,
with and without arfuse.torch.FusionPass.

    python crates/python/bench/precision_casts.py [--world 2]

The model, its shards and the token counts are those of crates/python/tests (2-layer
Hugging Face Llama, H = 256, bf16; gloo on localhost, `--world` processes). With the
pass, the compiled model is compared with the eager reference that computes each fused
chain as arfuse's rounding contract does; without it, with plain torch eager (gloo's
sum, Hugging Face's RMSNorm). Inductor's caches are off, so each of the four
compilations is a real one. Rank 0 prints one line per case: mismatching elements per
token count, of how many.
"""

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import arfuse  # noqa: E402
import arfuse.torch  # noqa: E402,F401
import gloo_worker as gw  # noqa: E402


def compiled_outputs(model, ids, fusion):
    torch._inductor.config.post_grad_custom_post_pass = fusion
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    first = ids[0].clone()
    torch._dynamo.mark_dynamic(first, 1, min=2, max=8192)
    return [compiled(first)] + [compiled(i) for i in ids[1:]]


def rank_main(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        torch._dynamo.config.specialize_float = True
        torch._inductor.config.compile_threads = 1
        torch._inductor.config.force_disable_caches = True
        group = dist.group.WORLD.group_name
        model, cfg = gw.build(world, rank, group, fp8=False)
        ids = [
            torch.randint(0, cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(t))
            for t in gw.TOKENS
        ]
        with torch.no_grad():
            gw.CONTRACT_EAGER = True
            contract = [model(i) for i in ids]
            gw.CONTRACT_EAGER = False
            plain = [model(i) for i in ids]
            gw.CONTRACT_EAGER = True
            for emulate in (False, True):
                torch._inductor.config.emulate_precision_casts = emulate
                for with_pass in (True, False):
                    fusion = arfuse.torch.FusionPass(arfuse.Target.preset(f"h200-sxm-x{world}")) if with_pass else None
                    outs = compiled_outputs(model, ids, fusion)
                    ref, name = (contract, "contract eager") if with_pass else (plain, "plain eager")
                    counts = [f"{gw.mismatches(o, e)}/{o.numel()}" for o, e in zip(outs, ref)]
                    if rank == 0:
                        print(
                            f"emulate_precision_casts={emulate!s:<5} pass={'on ' if with_pass else 'off'} "
                            f"vs {name:<14}: T={gw.TOKENS}: {', '.join(counts)} elements differ",
                            flush=True,
                        )
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args.world, port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
