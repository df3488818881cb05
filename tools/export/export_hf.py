"""torch.export of every config in a directory, as TP ranks with inserted all-reduces.

For each config: the layers `hf_models.arch_for` gives, two TP sizes, a dynamic token
dim (`T` in 2..8192) and a static one (`T = STATIC_T`), batch 1. Each program is
written as gzip-compressed ExportedProgram JSON (torch.export's own serializer; `gunzip`
gives the file torch wrote) to OUT/<stem>_L<layers>_tp<tp>_<dyn|static>.json.gz, and
OUT/manifest.json lists every export with what it was built from.

    python tools/export/export_hf.py --configs ir-fixtures/configs --out ir-fixtures/exported/hf

Needs torch and transformers (see tools/export/README.md); CI never runs it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models  # noqa: E402

STATIC_T = 32
GROUP = "0"  # the process-group name the all-reduces carry


def export_one(config_file: str, layers: int, tp: int, dynamic: bool):
    from torch._export.serde.serialize import serialize
    from torch.export import Dim

    model, cfg, paths = hf_models.build(
        config_file, layers, tp, hf_models.functional_all_reduce(GROUP)
    )
    k = hf_models.token_multiple(cfg)
    top = hf_models.max_tokens(cfg)
    if k > 1:
        t = 2 * k if dynamic else max(STATIC_T, k)
        dim = Dim("Tc", min=1, max=top // k) * k
    else:
        t = 16 if dynamic else STATIC_T
        dim = Dim("T", min=2, max=top)
    ids = torch.zeros(1, t, dtype=torch.long, device="meta")
    shapes = {"input_ids": {1: dim}} if dynamic else None
    with torch.no_grad():
        ep = torch.export.export(model, (ids,), dynamic_shapes=shapes)
    return serialize(ep).exported_program, cfg, paths


def token_note(cfg, dynamic: bool) -> str:
    k = hf_models.token_multiple(cfg)
    top = hf_models.max_tokens(cfg)
    if dynamic:
        return f"dynamic {k}*Tc, Tc in 1..{top // k}" if k > 1 else f"dynamic 2..{top}"
    return f"static {max(STATIC_T, k)}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", required=True, help="directory of config.json files")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--only", default="", help="comma-separated config stems to export")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    os.makedirs(args.out, exist_ok=True)
    manifest_path = os.path.join(args.out, "manifest.json")
    manifest = {"exports": []}
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
    only = {s for s in args.only.split(",") if s}
    failures = []
    for config_file in sorted(glob.glob(os.path.join(args.configs, "*.json"))):
        stem = hf_models.stem_of(config_file)
        if only and stem not in only:
            continue
        d = hf_models.load_config_dict(config_file)
        arch = hf_models.arch_for(d)
        for tp in arch.tp_sizes:
            for dynamic in (True, False):
                name = f"{stem}_L{arch.layers}_tp{tp}_{'dyn' if dynamic else 'static'}"
                start = time.time()
                try:
                    data, cfg, paths = export_one(config_file, arch.layers, tp, dynamic)
                except Exception as e:  # noqa: BLE001 - reported per export
                    failures.append((name, repr(e)))
                    traceback.print_exc()
                    continue
                path = os.path.join(args.out, name + ".json.gz")
                with gzip.GzipFile(path, "wb", mtime=0) as f:
                    f.write(data)
                entry = {
                    "file": name + ".json.gz",
                    "config": os.path.basename(config_file),
                    "model_type": d["model_type"],
                    "built_as": type(cfg).__name__,
                    "hidden_size": cfg.hidden_size,
                    "layers": arch.layers,
                    "tp": tp,
                    "tokens": token_note(cfg, dynamic),
                    "all_reduces_after": paths,
                    "notes": arch.notes,
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                }
                manifest["exports"] = [
                    e for e in manifest["exports"] if e["file"] != entry["file"]
                ] + [entry]
                manifest["exports"].sort(key=lambda e: e["file"])
                with open(manifest_path, "w") as f:
                    json.dump(manifest, f, indent=1)
                    f.write("\n")
                print(
                    f"{name}: {len(data)} bytes JSON, {os.path.getsize(path)} gzipped, "
                    f"{time.time() - start:.1f} s",
                    flush=True,
                )
    for name, why in failures:
        print(f"FAILED {name}: {why}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
