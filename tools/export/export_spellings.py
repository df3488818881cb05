"""The other all-reduce spellings real code exports, on Llama-3.1-8B (2 layers, TP 8).

- `dist_all_reduce`: the model calls `torch.distributed.all_reduce(y)` (in place) on an
  initialised gloo group; torch.export traces it to `_c10d_functional.all_reduce`,
  `wait_tensor` and `aten.copy_` back into `y`.
- `inplace_functional`: the model calls `torch.ops._c10d_functional.all_reduce_` (the
  in-place functional collective) and `wait_tensor`.
- `vllm_all_reduce`: a framework's own op, `vllm::all_reduce(Tensor tensor, str
  group_name) -> Tensor` (vLLM's schema), registered here with torch.library and a fake
  kernel; arfuse imports it only when told (`--all-reduce-op vllm.all_reduce`).

Each is written as OUT/llama_3_1_8b_instruct_L2_tp8_<spelling>.json.gz (gzip-compressed
ExportedProgram JSON, dynamic T in 2..8192).

    python tools/export/export_spellings.py --configs ir-fixtures/configs --out ir-fixtures/exported/spellings
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402

CONFIG = "meta-llama__Llama-3.1-8B-Instruct.json"
LAYERS, TP = 2, 8


def register_vllm_all_reduce():
    """`vllm::all_reduce` as vLLM declares it (out of place, group by name)."""
    lib = torch.library.Library("vllm", "FRAGMENT")
    lib.define("all_reduce(Tensor tensor, str group_name) -> Tensor")

    def impl(tensor, group_name):
        return tensor.clone()

    lib.impl("all_reduce", impl, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm::all_reduce", lib=lib)(impl)
    return lib


def main():
    from torch._export.serde.serialize import serialize
    from torch.export import Dim

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    _lib = register_vllm_all_reduce()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.configs, CONFIG)
    stem = hf_models.stem_of(path)
    group = dist.group.WORLD.group_name
    for name in ("dist_all_reduce", "inplace_functional", "vllm_all_reduce"):
        ar = hf_models.spelled_all_reduce(name, group)
        model, _, _ = hf_models.build(path, LAYERS, TP, ar)
        ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
        with torch.no_grad():
            ep = torch.export.export(
                model, (ids,), dynamic_shapes={"input_ids": {1: Dim("T", min=2, max=8192)}}
            )
        data = serialize(ep).exported_program
        out = os.path.join(args.out, f"{stem}_L{LAYERS}_tp{TP}_{name}.json.gz")
        with gzip.GzipFile(out, "wb", mtime=0) as f:
            f.write(data)
        print(f"{out}: {len(data)} bytes JSON, {os.path.getsize(out)} gzipped", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
