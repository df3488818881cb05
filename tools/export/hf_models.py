"""Hugging Face decoder models as one tensor-parallel rank of a serving engine sees them.

Shared by export_hf.py (torch.export) and capture_postgrad.py (torch.compile). A model
is built from a real config.json, cut to a few layers, with every dimension that a
tensor-parallel engine shards divided by the TP size (attention and Mamba heads, MLP and
expert intermediate sizes, the vocabulary of the vocab-parallel embedding), and the
all-reduces the engine runs inserted as torch functional collectives: after the
embedding lookup and after every row-parallel projection (attention o_proj, MLP
down_proj, Mamba out_proj) or MoE block.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch
from torch import nn

# What each config field is divided by the TP size (heads and intermediate sizes are
# sharded; experts are not: every rank holds a slice of every expert, as vLLM's
# tensor-parallel MoE does).
SHARDED_FIELDS = (
    "num_attention_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "mamba_num_heads",
)
# Replicated once the TP size exceeds them (a KV head is never split).
KV_FIELDS = ("num_key_value_heads",)

# The fields the configs add that are not the model's (provenance notes).
NOT_CONFIG_FIELDS = ("_source", "_hf_quant_config")


@dataclass
class Arch:
    """How one config is built: the layer count and the two TP sizes."""

    layers: int
    tp_sizes: tuple[int, int]
    notes: list[str] = field(default_factory=list)


def stem_of(config_file: str) -> str:
    """`meta-llama__Llama-3.1-8B-Instruct.json` -> `llama_3_1_8b_instruct`."""
    name = os.path.basename(config_file).removesuffix(".json").split("__", 1)[-1]
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def load_config_dict(path: str) -> dict:
    with open(path) as f:
        d = json.load(f)
    for k in NOT_CONFIG_FIELDS:
        d.pop(k, None)
    return d


def arch_for(d: dict) -> Arch:
    """The layers to build (enough for every layer kind the config has) and TP sizes."""
    mt = d["model_type"]
    notes = []
    if mt == "nemotron_h":
        # The first six blocks of the hybrid pattern hold every block kind: Mamba (M),
        # MoE (E) and attention (*).
        layers = 6
    elif d.get("first_k_dense_replace", 0) > 1:
        # Dense layers first, then one MoE layer.
        layers = d["first_k_dense_replace"] + 1
    else:
        layers = 2
    heads = d.get("num_attention_heads", 0)
    tp = (2, 8) if heads % 8 == 0 else (2, 4)
    if d.get("quantization_config"):
        q = d["quantization_config"]
        notes.append(
            "quantization_config ({}) dropped: transformers applies it only when loading a "
            "checkpoint; the graph is the bf16 model".format(q.get("quant_method", "?"))
        )
    return Arch(layers=layers, tp_sizes=tp, notes=notes)


def build_config(d: dict, layers: int, tp: int):
    """The transformers config of one TP rank with `layers` layers."""
    from transformers import AutoConfig, DeepseekV3Config

    d = dict(d)
    d.pop("quantization_config", None)
    mt = d.pop("model_type")

    def make(fields):
        if mt == "kimi_k2":
            # transformers has no kimi_k2 model type; the config names
            # DeepseekV3ForCausalLM as its architecture and uses DeepSeek-V3's fields.
            return DeepseekV3Config(**fields)
        return AutoConfig.for_model(mt, **fields)

    full = make(dict(d))
    head_dim = getattr(full, "head_dim", None)
    if isinstance(head_dim, int) and "head_dim" not in d:
        d["head_dim"] = head_dim  # keep it when the head count is divided
    d["num_hidden_layers"] = layers
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][:layers]
    if isinstance(d.get("hybrid_override_pattern"), str):
        d["hybrid_override_pattern"] = d["hybrid_override_pattern"][:layers]
    for k in SHARDED_FIELDS:
        v = d.get(k)
        if isinstance(v, int) and v > 0:
            if v % tp:
                raise ValueError(f"{k} = {v} is not divisible by TP {tp}")
            d[k] = v // tp
    for k in KV_FIELDS:
        v = d.get(k)
        if isinstance(v, int) and v > 0:
            d[k] = max(1, v // tp)
    g = d.get("n_groups")
    if isinstance(g, int) and g % tp == 0:
        d["n_groups"] = g // tp  # Mamba2 groups are sharded with the heads
    d["vocab_size"] = -(-d["vocab_size"] // tp)  # the vocab-parallel embedding's shard
    # A vocab-parallel embedding has no padding index (it only affects gradients); a
    # pad id past the shard would not even be a valid one.
    d["pad_token_id"] = None
    d["use_cache"] = False
    return make(d)


class AllReduceAfter(nn.Module):
    """Runs `inner`, then sums its output (the first one of a tuple) over the group."""

    def __init__(self, inner: nn.Module, all_reduce):
        super().__init__()
        self.inner = inner
        self.all_reduce = all_reduce

    def forward(self, *args, **kwargs):
        y = self.inner(*args, **kwargs)
        if isinstance(y, tuple):
            return (self.all_reduce(y[0]),) + tuple(y[1:])
        return self.all_reduce(y)


class ScaledEmbedding(nn.Module):
    """A scaled embedding (Gemma's `embedding * sqrt(H)`) with the all-reduce where a
    vocab-parallel embedding has it: after the lookup, before the scale."""

    def __init__(self, scaled: nn.Embedding, all_reduce):
        super().__init__()
        self.weight = scaled.weight
        self.padding_idx = scaled.padding_idx
        self.embed_scale = scaled.embed_scale
        self.all_reduce = all_reduce

    def forward(self, input_ids):
        y = nn.functional.embedding(input_ids, self.weight, self.padding_idx)
        return self.all_reduce(y) * self.embed_scale.to(self.weight.dtype)


def functional_all_reduce(group: str):
    """`torch.ops._c10d_functional.all_reduce` + `wait_tensor` (tracing needs no process
    group)."""

    def ar(y):
        y = torch.ops._c10d_functional.all_reduce(y, "sum", group)
        return torch.ops._c10d_functional.wait_tensor(y)

    return ar


def spelled_all_reduce(spelling: str, group: str):
    """The all-reduce written the way other code writes it:

    - `functional`: `_c10d_functional.all_reduce` + `wait_tensor` (the default);
    - `dist_all_reduce`: `torch.distributed.all_reduce(y)` in place (needs an
      initialised process group);
    - `inplace_functional`: `_c10d_functional.all_reduce_` + `wait_tensor`;
    - `vllm_all_reduce`: `torch.ops.vllm.all_reduce(y, "tp:0")` (register it first).
    """
    import torch.distributed as dist

    def dist_all_reduce(y):
        y = y.clone()
        dist.all_reduce(y)
        return y

    def inplace_functional(y):
        torch.ops._c10d_functional.all_reduce_(y, "sum", group)
        return torch.ops._c10d_functional.wait_tensor(y)

    def vllm_all_reduce(y):
        return torch.ops.vllm.all_reduce(y, "tp:0")

    return {
        "functional": functional_all_reduce(group),
        "dist_all_reduce": dist_all_reduce,
        "inplace_functional": inplace_functional,
        "vllm_all_reduce": vllm_all_reduce,
    }[spelling]


def token_multiple(cfg) -> int:
    """The token counts a model traces for without specialising: Mamba2's chunked
    scan pads the sequence to a multiple of its chunk size, so Nemotron-H's dynamic T
    is `chunk_size * k`."""
    layer_kinds = getattr(cfg, "layers_block_type", None) or []
    if any(k == "linear_attention" for k in layer_kinds):  # Mamba2 blocks
        return int(cfg.chunk_size)
    return 1


def max_tokens(cfg) -> int:
    """The largest dynamic T: 8192, or the DSA indexer's top-k (GLM-5 selects
    `min(index_topk, T)` keys, and torch.export cannot prove that guard for T above
    it)."""
    k = getattr(cfg, "index_topk", None)
    return min(8192, k) if isinstance(k, int) and k > 0 else 8192


def is_moe(m: nn.Module) -> bool:
    return hasattr(m, "experts")


def insert_all_reduces(model: nn.Module, all_reduce) -> list[str]:
    """Wraps the modules after which a TP engine all-reduces; returns their paths."""
    base = model.model
    done = []
    emb_name = "embed_tokens" if hasattr(base, "embed_tokens") else "embeddings"
    emb = getattr(base, emb_name)
    if hasattr(emb, "embed_scale"):
        setattr(base, emb_name, ScaledEmbedding(emb, all_reduce))
    else:
        setattr(base, emb_name, AllReduceAfter(emb, all_reduce))
    done.append(f"model.{emb_name}")
    for i, layer in enumerate(base.layers):
        p = f"model.layers.{i}"
        if hasattr(layer, "mixer"):  # Nemotron-H: one mixer a block
            mixer = layer.mixer
            if is_moe(mixer):
                layer.mixer = AllReduceAfter(mixer, all_reduce)
                done.append(f"{p}.mixer")
            else:
                for proj in ("o_proj", "out_proj", "down_proj"):
                    if hasattr(mixer, proj):
                        setattr(mixer, proj, AllReduceAfter(getattr(mixer, proj), all_reduce))
                        done.append(f"{p}.mixer.{proj}")
            continue
        attn = layer.self_attn
        attn.o_proj = AllReduceAfter(attn.o_proj, all_reduce)
        done.append(f"{p}.self_attn.o_proj")
        mlp = layer.mlp
        if is_moe(mlp):
            layer.mlp = AllReduceAfter(mlp, all_reduce)
            done.append(f"{p}.mlp")
        else:
            mlp.down_proj = AllReduceAfter(mlp.down_proj, all_reduce)
            done.append(f"{p}.mlp.down_proj")
    return done


class Wrap(nn.Module):
    """`input_ids -> last hidden state` of the decoder stack (no LM head)."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        return self.m.model(input_ids=input_ids, use_cache=False).last_hidden_state


def build(config_file: str, layers: int, tp: int, all_reduce, device="meta"):
    """The wrapped model of one TP rank, bf16, and the all-reduce paths inserted."""
    from transformers import AutoModelForCausalLM

    cfg = build_config(load_config_dict(config_file), layers, tp)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    paths = insert_all_reduces(model, all_reduce)
    return Wrap(model), cfg, paths
