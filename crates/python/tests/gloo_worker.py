"""One rank of the multi-process test (test_fusion_pass_gloo.py), spawned with
torch.multiprocessing on a gloo group on localhost.

The model is a 2-layer Hugging Face Llama with random weights and H = 256 (the fused
kernels' smallest bf16 row, 512 bytes), one tensor-parallel rank of it built by
tools/export/hf_models.py (heads, MLP and vocabulary sharded), with the all-reduces as
functional collectives after the embedding and every row-parallel projection.

The eager reference computes each fused chain as arfuse's rounding contract defines it:
the all-reduce sums every rank's input in rank order in f32 from +0.0 (clause 1; gloo's
own sum has another order and rounds at every step, which at W = 4 gives other bits),
and the RMSNorm sums the squares in the kernels' block tree and takes 1 / sqrt (clause 3
in the kernels' order, which the fused op's kernels compute; torch's CPU `mean` reduces
in another order and its `rsqrt` is not the correctly rounded 1 / sqrt).
Everything else is torch eager. Under torch.compile the model traces the plain Hugging
Face code (`torch.compiler.is_compiling()`), which is what the pass sees and fuses. That
these torch-op forms are the contract is asserted first (`check_reference`), against
the fused op's CPU kernel (Rust, arfuse-reference).

Each rank asserts; rank 0 writes a JSON summary of what it measured to OUT/summary_W.json.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "tools", "export"))

import hf_models  # noqa: E402

import arfuse  # noqa: E402
import arfuse.torch  # noqa: E402,F401  (registers torch.ops.arfuse.*)

LAYERS = 2
HIDDEN = 256


def config(world: int) -> dict:
    """The whole model's config for `world` ranks, sized so that every rank's shard is the
    same at every W (2 heads of 32, 1 KV head, MLP 128, vocabulary 128 per rank): the
    per-rank graphs are then equal and inductor compiles their kernels once."""
    return {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 128 * world,
        "num_attention_heads": 2 * world,
        "num_key_value_heads": world,
        "head_dim": 32,
        "vocab_size": 128 * world,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }


FUSED_CALL = "torch.ops.arfuse.fused_allreduce_rms_norm.default("
TOKENS = (16, 7)

# True: eager computes the fused chains as the contract does (the reference); False:
# plain torch eager (gloo's sum, torch's RMSNorm), measured only.
CONTRACT_EAGER = True


def contract_all_reduce(y: torch.Tensor, group: str) -> torch.Tensor:
    """Clause 1: every rank's y, summed in rank order in f32 from +0.0, rounded once."""
    pg = torch.distributed.distributed_c10d._resolve_process_group(group)
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(parts, y.contiguous(), group=pg)
    acc = torch.zeros(y.shape, dtype=torch.float32)
    for p in parts:
        acc = acc + p.float()
    return acc.to(y.dtype)


def kernel_sum_of_squares(h: torch.Tensor) -> torch.Tensor:
    """Clause 3's sum of squares in arfuse's kernels' block tree (the contract's
    `SumOrder::KernelTree`, `arfuse_reference::contract::sum_of_squares`), which the
    fused op's kernels compute: B threads (`arfuse_policy::arfuse_block_threads`: whole
    warps, at least 128, at most 4 vectors each), each summing the squares of its 16-byte
    vectors t, t + B, ... element by element; each warp's 32 lane sums combined by the
    butterfly `v_l += v_(l ^ o)`, o = 16, 8, 4, 2, 1; the warp totals by the same
    butterfly. For 16-bit rows (8 elements per vector)."""
    per_vec = 8
    nvec = h.shape[-1] // per_vec
    per_thread = -(-nvec // 1024)
    block = max(-(-(-(-nvec // per_thread)) // 32) * 32, 128)
    sq = h * h
    vec = torch.zeros(tuple(h.shape[:-1]) + (nvec,), dtype=torch.float32)
    for i in range(per_vec):
        vec = vec + sq[..., i::per_vec]
    lanes = torch.zeros(tuple(h.shape[:-1]) + (block,), dtype=torch.float32)
    for v in range(per_thread):
        part = vec[..., v * block : (v + 1) * block]
        lanes[..., : part.shape[-1]] = lanes[..., : part.shape[-1]] + part

    def butterfly(x: torch.Tensor) -> torch.Tensor:
        idx = torch.arange(32)
        for o in (16, 8, 4, 2, 1):
            x = x + x[..., idx ^ o]
        return x[..., 0]

    totals = torch.zeros(tuple(h.shape[:-1]) + (32,), dtype=torch.float32)
    for w in range(block // 32):
        totals[..., w] = butterfly(lanes[..., w * 32 : (w + 1) * 32])
    return butterfly(totals).unsqueeze(-1)


def contract_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Clause 3, `twice` (Llama's order), as arfuse's kernels compute it: the f32 sum of
    squares in the kernels' block tree, r = 1 / sqrt(ss / H + eps), n = round(h * r),
    y = round(n * w)."""
    h = x.float()
    ss = kernel_sum_of_squares(h)
    r = torch.ones_like(ss) / torch.sqrt(ss / h.shape[-1] + eps)
    n = (h * r).to(x.dtype)
    return (n.float() * weight.float()).to(x.dtype)


def all_reduce_for(group: str):
    def ar(y):
        if torch.compiler.is_compiling() or not CONTRACT_EAGER:
            y = torch.ops._c10d_functional.all_reduce(y, "sum", group)
            return torch.ops._c10d_functional.wait_tensor(y)
        return contract_all_reduce(y, group)

    return ar


def norm_classes():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class ContractRMSNorm(LlamaRMSNorm):
        def forward(self, x):
            if torch.compiler.is_compiling() or not CONTRACT_EAGER:
                return super().forward(x)
            return contract_rms_norm(x, self.weight, self.variance_epsilon)

    class QuantRMSNorm(ContractRMSNorm):
        """An FP8 model's norm: the per-token FP8 quant the next GEMM reads, here
        dequantized for the bf16 CPU GEMM."""

        def forward(self, x):
            y = super().forward(x)
            q, s = torch.ops.arfuse.quant_fp8_per_token(y)
            return (q.to(torch.float32) * s).to(y.dtype)

    return ContractRMSNorm, QuantRMSNorm


def build(world: int, rank: int, group: str, fp8: bool):
    """One rank of the model: sharded weights random per rank, norm weights shared."""
    from transformers import AutoModelForCausalLM

    cfg = hf_models.build_config(config(world), LAYERS, world)
    torch.manual_seed(1000 + rank)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    hf_models.insert_all_reduces(model, all_reduce_for(group))
    contract_cls, quant_cls = norm_classes()
    shared = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, name).__class__ = quant_cls if fp8 else contract_cls
    model.model.norm.__class__ = contract_cls
    for m in model.modules():
        if isinstance(m, contract_cls):
            with torch.no_grad():
                m.weight.copy_(1 + 0.25 * torch.randn(m.weight.shape, generator=shared))
    return hf_models.Wrap(model), cfg


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((bits(a) != bits(b)).sum())


def check_reference(rank: int, world: int, group: str) -> dict:
    """The eager reference's torch-op forms equal the fused op (arfuse's kernels on the
    host device, across the group's processes) bit for bit, on rows of realistic magnitude; and at W = 2 gloo's own
    sum equals clause 1 (one addition is the same in any order)."""
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(64, HIDDEN, generator=g) * 3).to(torch.bfloat16)
    res = (torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(99 + rank))).to(torch.bfloat16)
    w = (1 + 0.25 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)
    norm, h, _, _ = torch.ops.arfuse.fused_allreduce_rms_norm(x, res, w, group, 1e-5, 0.0, True, False, "none")
    a = contract_all_reduce(x, group)
    want_h = (a.float() + res.float()).to(torch.bfloat16)
    assert mismatches(h, want_h) == 0
    assert mismatches(norm, contract_rms_norm(want_h, w, 1e-5)) == 0
    _, _, q, s = torch.ops.arfuse.fused_allreduce_rms_norm(x, res, w, group, 1e-5, 0.0, True, False, "fp8_per_token")
    q2, s2 = torch.ops.arfuse.quant_fp8_per_token(norm)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    gloo = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group))
    gloo_vs_contract = mismatches(gloo, a)
    if world == 2:
        assert gloo_vs_contract == 0
    # torch's own RMSNorm (HF's code) against the contract, for the record.
    hf = w * (want_h.float() * torch.rsqrt(want_h.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    return {
        "gloo_sum_vs_contract_mismatches": gloo_vs_contract,
        "hf_rms_norm_vs_contract_mismatches": mismatches(hf, norm),
        "elements": x.numel(),
    }


# The epilogue check's rows: 10 groups of 128 (3 packed UE8M0 words per token, the last
# partial) and 80 NVFP4 blocks; T = 150 runs as three calls of the op's kernels (64, 64
# and 22 tokens), crosses a 128-row NVFP4 scale tile and is not a multiple of 4, so every
# scale layout has padding.
EPILOGUE_HIDDEN = 1280
EPILOGUE_TOKENS = 150


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of `t`'s storage (a strided layout's padding included)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def check_epilogues(rank: int, world: int, group: str) -> dict:
    """Every quant epilogue of the fused op (arfuse's kernels across the group's
    processes): residual and norm bit for bit against the contract, the quant data and
    scales (every byte, padding included) equal to the contract's quant of the op's own
    norm output (`arfuse.torch._quant_reference`), in the layouts vLLM allocates."""
    t0 = time.perf_counter()
    h, t = EPILOGUE_HIDDEN, EPILOGUE_TOKENS
    g = torch.Generator().manual_seed(10 + rank)
    x = (torch.randn(t, h, generator=g) * 3).to(torch.bfloat16)
    res = torch.randn(t, h, generator=torch.Generator().manual_seed(20 + rank)).to(torch.bfloat16)
    w = (1 + 0.25 * torch.randn(h, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16)
    want_h = (contract_all_reduce(x, group).float() + res.float()).to(torch.bfloat16)
    want_norm = contract_rms_norm(want_h, w, 1e-5)
    # Static FP8 dequant scale 2^-7 (|y| above 3.5 saturates); NVFP4 global scale 64.
    scales = {"fp8_static": torch.tensor([0.0078125]), "nvfp4": torch.tensor([64.0])}
    layouts = {}
    for tag, quant in enumerate(arfuse.torch.OP_QUANTS):
        scale_in = scales.get(quant.split(":")[0])
        norm, h_out, q, s = torch.ops.arfuse.fused_allreduce_rms_norm(
            x, res, w, group, 1e-5, 0.0, True, False, quant, tag, scale_in
        )
        assert mismatches(h_out, want_h) == 0, quant
        assert mismatches(norm, want_norm) == 0, quant
        q2, s2 = arfuse.torch._quant_reference(norm, quant, scale_in)
        for got, want in ((q, q2), (s, s2)):
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), quant
            assert torch.equal(storage_bytes(got), storage_bytes(want)), quant
        layouts[quant] = [str(q.dtype), list(q.shape), str(s.dtype), list(s.shape), list(s.stride())]
    assert layouts["fp8_per_token_group:packed_ue8m0"][3:] == [[t, 3], [1, 152]]
    assert layouts["nvfp4:swizzled_128x4"][1:4] == [[t, h // 2], "torch.float8_e4m3fn", [256, 80]]
    return {"layouts": layouts, "seconds": round(time.perf_counter() - t0, 1)}


def site_names(prefix: str, fp8: bool) -> list:
    """`<all-reduce module> -> <norm module>` of every site, in graph order. (The
    rewrite's report names a site whose norm output is only quantised by its all-reduce
    module alone: the norms before the FP8 quant.)"""

    def name(ar: str, norm: str, quantised: bool) -> str:
        return f"{prefix}{ar}" if quantised else f"{prefix}{ar} -> {prefix}{norm}"

    names = [name("model.embed_tokens", "model.layers.0.input_layernorm", fp8)]
    for i in range(LAYERS):
        last = i + 1 == LAYERS
        nxt = "model.norm" if last else f"model.layers.{i + 1}.input_layernorm"
        names.append(name(f"model.layers.{i}.self_attn.o_proj", f"model.layers.{i}.post_attention_layernorm", fp8))
        names.append(name(f"model.layers.{i}.mlp.down_proj", nxt, fp8 and not last))
    return names


def run_model(rank: int, world: int, group: str, fp8: bool) -> dict:
    """Eager reference, then torch.compile with the pass; asserts and returns figures."""
    global CONTRACT_EAGER
    from torch._inductor.utils import run_and_get_code

    model, cfg = build(world, rank, group, fp8)
    ids = [
        torch.randint(0, cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(t))
        for t in TOKENS
    ]
    with torch.no_grad():
        CONTRACT_EAGER = True
        eager = [model(i) for i in ids]
        CONTRACT_EAGER = False
        plain = [model(i) for i in ids]
        CONTRACT_EAGER = True
    target = arfuse.Target.preset(f"h200-sxm-x{world}")
    fusion = arfuse.torch.FusionPass(target)
    torch._inductor.config.post_grad_custom_post_pass = fusion
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model, backend=rank0_first(rank, f"{world}-{fp8}"), fullgraph=True)
    first = ids[0].clone()
    torch._dynamo.mark_dynamic(first, 1, min=2, max=8192)
    t0 = time.perf_counter()
    print(f"rank {rank}: eager done at {t0 - T_START:.1f} s", flush=True)
    with torch.no_grad():
        out0, code = run_and_get_code(compiled, first)
        compile_s = time.perf_counter() - t0
        print(f"rank {rank}: compiled + first run {compile_s:.1f} s", flush=True)
        outs = [out0] + [compiled(i) for i in ids[1:]]
    for t, e, o in zip(TOKENS, eager, outs):
        assert o.dtype == torch.bfloat16 and o.shape == e.shape
        assert mismatches(o, e) == 0, f"T={t}: {mismatches(o, e)} of {o.numel()} elements differ from eager"
    figures = {
        "compile_and_first_run_s": round(compile_s, 2),
        "plain_eager_vs_compiled_mismatches": [mismatches(o, p) for o, p in zip(outs, plain)],
        "elements": [o.numel() for o in outs],
    }
    hits = counters["inductor"]["fxgraph_cache_hit"]
    if rank != 0:
        # Rank 0's compiled graph, with its fused calls, served by inductor's FX graph
        # cache under the pass's uuid: the pass did not run here.
        assert hits == 1 and not fusion.reports, (dict(counters["inductor"]), len(fusion.reports))
        return figures
    # Rank 0 compiled it (at W = 4 too: the W = 2 run's entry for the same graph is
    # not served, the target and so the uuid differ).
    assert hits == 0 and counters["inductor"]["fxgraph_cache_miss"] == 1, dict(counters["inductor"])
    sites = 2 * LAYERS + 1
    text = "\n".join(code)
    assert text.count(FUSED_CALL) == sites, text
    assert "_c10d_functional.all_reduce" not in text and "wait_tensor" not in text, text
    assert len(fusion.reports) == 1, "one graph, compiled once (dynamic T)"
    report = fusion.reports[0]
    assert report["all_reduces_seen"] == sites and report["all_reduces_fused"] == sites, str(report)
    prefix = report["sites"][0]["name"].split("model.embed_tokens")[0]
    assert report.site_names == site_names(prefix, fp8), str(report)
    patterns = {k: v["fused"] for k, v in report["by_pattern"].items()}
    # Llama's norm rounds twice (`w * x_normed.to(T)`); the first site has no residual.
    quant = "+fp8_per_token" if fp8 else ""
    want = {
        f"allreduce+rms_norm(round_twice){quant}": 1,
        f"allreduce+residual+rms_norm(round_twice){quant}": 2 * LAYERS - 1,
        "allreduce+residual+rms_norm(round_twice)": 1,
    }
    if not fp8:
        want = {"allreduce+rms_norm(round_twice)": 1, "allreduce+residual+rms_norm(round_twice)": 2 * LAYERS}
    assert patterns == want, patterns
    return dict(figures, site_names=report.site_names, patterns=patterns, table=str(report))


def rank0_first(rank: int, key: str):
    """Inductor's compile_fx, rank 0 first: the other ranks wait until rank 0's compiled
    graph is in inductor's FX graph cache, then compile the same graph (a cache hit).
    Rank 0 runs on as soon as it has compiled (its first collective waits for them)."""
    from torch._inductor.compile_fx import compile_fx

    store = dist.distributed_c10d._get_default_store()

    def backend(gm, example_inputs):
        if rank != 0:
            store.wait([key])
        fn = compile_fx(gm, example_inputs)
        if rank == 0:
            store.set(key, "compiled")
        return fn

    return backend


T_START = time.perf_counter()


def worker(rank: int, world: int, port: int, out_dir: str, models: tuple) -> None:
    print(f"rank {rank}: started at {time.perf_counter() - T_START:.1f} s", flush=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        torch._dynamo.config.specialize_float = True
        torch._inductor.config.emulate_precision_casts = True
        # Compile inductor's kernels in this process: a pool of compile workers per rank
        # costs more to start than it saves on two cores.
        torch._inductor.config.compile_threads = 1
        group = dist.group.WORLD.group_name
        summary = {"world": world, "reference": check_reference(rank, world, group)}
        if world == 2:
            # Every epilogue at one W (each compiles two kernels on the host).
            summary["epilogues"] = check_epilogues(rank, world, group)
        for name in models:
            summary[name] = run_model(rank, world, group, fp8=(name == "fp8"))
        if rank == 0:
            with open(os.path.join(out_dir, f"summary_{world}.json"), "w") as f:
                json.dump(summary, f, indent=1)
    finally:
        dist.destroy_process_group()
