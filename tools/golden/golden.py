#!/usr/bin/env python3
"""Golden vectors for arfuse rounding contract v2, clause 4 (quant epilogues).

Computes, with torch on the CPU (IEEE binary32, one rounding per operation), the
quant formulas of the engine kernels users compare arfuse's fused output with, in
those kernels' operation order, and writes them to one compact binary file that
the Rust test `crates/reference/tests/golden.rs` compares the reference against
bit for bit. Re-run by hand (`/work/venv/bin/python tools/golden/golden.py`); CI
reads the committed file and needs no torch.

Oracles (formulas as the engines write them; the sources are named per form):
- static FP8: vLLM `static_scaled_fp8_quant` (csrc/quantization/w8a8/fp8/common.cu,
  `scaled_fp8_quant_kernel_strided`: `inv_scale = 1.0f / *scale`, then
  `scaled_fp8_conversion<true>`: `val * inv_scale`, clamp to +-448, cast);
  FlashInfer's fused kernel (trtllm_allreduce_fusion.cuh, `m_scale_factor =
  1.f / *scale_factor`, `val * m_scale_factor`, satfinite cast) has the same order.
- dynamic per-token FP8: vLLM `ref_dynamic_per_token_quant` (tests/kernels/
  quant_utils.py) = `dynamic_per_token_scaled_fp8_quant_kernel_strided`:
  `scale = max(amax / 448, 1 / (448 * 512))`, `q = clamp(y / scale)`; FlashInfer
  `dynamic_token_fp8_scale` (patterns 10/11) is the same.
- per-token-group FP8, f32 scales: vLLM `native_per_token_group_quant_fp8`
  (tests/kernels/quant_utils.py), `per_token_group_quant_8bit_kernel` and its
  register variant (csrc/quantization/w8a8/fp8/per_token_group_quant.cu) and the
  Triton `_per_token_group_quant_fp8`: `scale = max(amax, 1e-10) / 448`,
  `q = clamp(y / scale)`.
- per-token-group FP8, UE8M0 (power-of-two) scales, stored as f32 or packed:
  vLLM's register kernels (`SCALE_UE8M0`, and
  `per_token_group_quant_8bit_packed_register_kernel`): `s = max(max(amax, 1e-10)
  / 448, 1e-10)`, rounded up to a power of two by bumping the exponent when the
  mantissa is not zero; `q = clamp(y * (1 / s))` (exact: s is a power of two).
  FlashInfer's `compute_ue8m0_scale` (pattern 8/9) gives the same scale and
  divides by it (the same value). Packed storage as vLLM's
  `per_token_group_quant_fp8_packed_for_deepgemm` allocates it:
  `torch.empty_strided((T, C), (1, round_up(T, 4)))`, i.e.
  `T + (C - 1) * round_up(T, 4)` int32 words, C = ceil(G / 4).
- NVFP4: FlashInfer's fused kernel (trtllm_allreduce_fusion.cuh,
  `cvt_warp_fp16_to_fp4`): `SF = e4m3(gs * (amax * (1.0f / 6.0f)))`,
  `output_scale = SF != 0 ? gs / SF : 0`, `q = e2m1(y * output_scale)`.
  The script also prints how often FlashInfer's test reference `ref_fp4_quant`
  (tests/test_helpers/utils_fp4.py; the order of vLLM's `scaled_fp4_quant` and of
  FlashInfer's standalone `fp4_quantize`: `output_scale = 1 / (SF * (1 / gs))`)
  differs; that order is not the contract's.
- conversions: torch's casts to float8_e4m3fn (after a clamp to +-448), bfloat16
  and float16 (round to nearest even), and an e2m1 encoder written from the
  thresholds of FlashInfer's `cast_to_fp4` (ties to even, saturating at 6).

Inputs are finite (the engines disagree on NaN: see contract.rs, clause 4).

File format (all integers little-endian):
    b"ARFGOLD1"
    u32 set count; per set:
        u8 dtype (0 bf16, 1 f16, 2 f32), u8 0, u16 name length, name (UTF-8),
        u32 tokens, u32 hidden, tokens * hidden values as bit patterns
        (u16 for bf16/f16, u32 for f32), row-major [tokens, hidden]
    u32 case count; per case:
        u8 form (FORMS below), u8 0, u16 0, u32 set index, u32 parameter
        (f32 bits: static scale or NVFP4 global scale, else 0),
        u32 byte count, quant bytes, u32 byte count, scale bytes
"""

import argparse
import pathlib
import struct

import numpy as np
import torch

# Form ids: 1..7 are the kernels' ARF_QUANT values; 16.. are plain conversions.
FORMS = {
    "fp8_static": 1,
    "fp8_per_token": 2,
    "fp8_group_packed_ue8m0": 3,
    "fp8_group_f32": 4,
    "nvfp4_swizzled": 5,
    "nvfp4_linear": 6,
    "fp8_group_f32_ue8m0": 7,
    "cvt_e4m3": 16,
    "cvt_e2m1": 17,
    "cvt_bf16": 18,
    "cvt_f16": 19,
}
DTYPES = {"bf16": 0, "f16": 1, "f32": 2}
TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
F32 = torch.float32
GROUP = 128
BLOCK = 16


def f32(v):
    """A 0-d f32 tensor holding the f32 nearest to v."""
    return torch.tensor(v, dtype=F32)


# ------------------------------------------------------------------ encoders
def e4m3_codes(x):
    """e4m3 codes of f32 x after a clamp to +-448 (torch's cast rounds to nearest even)."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def e2m1_codes(x):
    """E2M1 codes (low nibble), round to nearest even, saturating at +-6.

    Thresholds as FlashInfer's cast_to_fp4: <= 0.25 -> 0, < 0.75 -> 0.5,
    <= 1.25 -> 1, < 1.75 -> 1.5, <= 2.5 -> 2, < 3.5 -> 3, <= 5 -> 4, else 6
    (each tie goes to the even code). The sign bit is kept, also for zeros.
    """
    a = x.abs()
    mag = torch.full(a.shape, 7, dtype=torch.int64)
    for code, upper, inclusive in [
        (0, 0.25, True),
        (1, 0.75, False),
        (2, 1.25, True),
        (3, 1.75, False),
        (4, 2.5, True),
        (5, 3.5, False),
        (6, 5.0, True),
    ]:
        below = (a <= upper) if inclusive else (a < upper)
        mag = torch.where((mag == 7) & below, torch.full_like(mag, code), mag)
    sign = torch.signbit(x).to(torch.int64) << 3
    return (mag | sign).to(torch.uint8)


def e4m3_decode(codes):
    return codes.view(torch.float8_e4m3fn).to(F32)


def pow2_ceil(s):
    """Round positive normal f32 values up to a power of two: exponent + 1 when the
    mantissa is not zero, then clear the mantissa (vLLM's register kernels)."""
    bits = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int64)
    return ((exp << 23).to(torch.int32)).view(F32)


def exponent_byte(s):
    return ((s.view(torch.int32).to(torch.int64) >> 23) & 0xFF).to(torch.uint8)


# ------------------------------------------------------------------ quant forms
def fp8_static(y, scale):
    inv = f32(1.0) / f32(scale)
    return e4m3_codes(y * inv), None


def fp8_per_token(y):
    amax = y.abs().amax(dim=-1, keepdim=True)
    min_scale = f32(1.0) / (f32(448.0) * f32(512.0))
    scale = torch.maximum(amax / f32(448.0), min_scale)
    return e4m3_codes(y / scale), scale.reshape(-1)


def group_amax(y):
    t, h = y.shape
    return y.reshape(t, h // GROUP, GROUP).abs().amax(dim=-1)


def group_f32_scale(y):
    return torch.maximum(group_amax(y), f32(1e-10)) / f32(448.0)


def group_ue8m0_scale(y):
    return pow2_ceil(torch.maximum(group_f32_scale(y), f32(1e-10)))


def group_quant(y, scale, multiply_by_inverse):
    t, h = y.shape
    yg = y.reshape(t, h // GROUP, GROUP)
    s = scale.unsqueeze(-1)
    q = yg * (f32(1.0) / s) if multiply_by_inverse else yg / s
    return e4m3_codes(q).reshape(t, h)


def fp8_group_f32(y):
    s = group_f32_scale(y)
    return group_quant(y, s, False), s.reshape(-1)


def fp8_group_f32_ue8m0(y):
    s = group_ue8m0_scale(y)
    return group_quant(y, s, True), s.reshape(-1)


def fp8_group_packed(y):
    s = group_ue8m0_scale(y)
    q = group_quant(y, s, True)
    t, g = s.shape
    cols = (g + 3) // 4
    tpad = (t + 3) // 4 * 4
    words = t + (cols - 1) * tpad
    buf = torch.zeros(words * 4, dtype=torch.uint8)
    codes = exponent_byte(s)
    for j in range(cols):
        for k in range(4):
            grp = 4 * j + k
            if grp >= g:
                break
            idx = (j * tpad + torch.arange(t)) * 4 + k
            buf[idx] = codes[:, grp]
    return q, buf


def nvfp4(y, gs, order):
    t, h = y.shape
    blocks = y.reshape(t, h // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    gs = f32(gs)
    sf = e4m3_codes(gs * (amax * (f32(1.0) / f32(6.0))))
    sff = e4m3_decode(sf)
    if order == "fused":
        out_scale = torch.where(sff != 0, gs / sff, torch.zeros_like(sff))
    else:
        inner = sff * (f32(1.0) / gs)
        out_scale = torch.where(inner != 0, f32(1.0) / inner, torch.zeros_like(inner))
    codes = e2m1_codes(blocks * out_scale).reshape(t, h)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return packed, sf.reshape(t, h // BLOCK)


def swizzle(sf):
    """Scale bytes [T, C] -> swizzled 128x4 tiles, zero padded
    (row i of a tile at byte (i % 32) * 16 + (i / 32) * 4, 4 columns contiguous)."""
    t, c = sf.shape
    rows = (t + 127) // 128 * 128
    cpad = (c + 3) // 4 * 4
    out = torch.zeros(rows * cpad, dtype=torch.uint8)
    r = torch.arange(t).unsqueeze(1).expand(t, c)
    k = torch.arange(c).unsqueeze(0).expand(t, c)
    off = ((r // 128) * (cpad // 4) + k // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + k % 4
    out[off.reshape(-1)] = sf.reshape(-1)
    return out


# ------------------------------------------------------------------ inputs
def all_finite(dt):
    """Every finite value of a 16-bit format, ascending bit patterns, as a [N/256, 256] tensor."""
    bits = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16)
    v = bits.view(TORCH_DTYPES[dt])
    v = v[torch.isfinite(v.to(F32))]
    n = v.numel() // 256 * 256
    return v[:n].reshape(-1, 256)


def realistic(dt, tokens, hidden, seed):
    """RMSNorm-like activations: unit normal rows with a few outliers, rounded to T."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=F32)
    rowscale = torch.exp(torch.randn(tokens, 1, generator=g) * 2.0)
    x = x * rowscale
    hot = torch.rand(tokens, hidden, generator=g) < 0.002
    x = torch.where(hot, x * 40.0, x)
    lim = torch.finfo(TORCH_DTYPES[dt]).max / 2
    return x.clamp(-lim, lim).to(TORCH_DTYPES[dt])


def edge_rows(dt, hidden):
    """Rows that hit the scale floors, zeros, signed zeros, saturation and NVFP4 ties."""
    tdt = TORCH_DTYPES[dt]
    rows = []
    fmax = torch.finfo(tdt).max
    tiny = [1e-12, 1e-11, 4.4e-11, 1e-10, 1e-9, 4.4e-8, 4.48e-8, 4.5e-8, 1e-7, 1e-6]
    rows.append(torch.zeros(hidden))
    rows.append(-torch.zeros(hidden))
    for v in tiny:
        r = torch.zeros(hidden)
        r[::3] = v
        r[1::7] = -v / 3
        rows.append(r)
    rows.append((torch.linspace(-1.0, 1.0, hidden, dtype=torch.float64) * fmax).to(F32))
    r = torch.zeros(hidden)
    r[5] = fmax
    r[6] = -1.0
    rows.append(r)
    # Powers of two and values next to them (UE8M0 rounding, exact scales).
    span = 28 if dt == "f16" else 40
    r = torch.tensor([2.0 ** (k % span - span // 2) * (1 + (k % 3) * 2.0**-7) for k in range(hidden)])
    rows.append(r)
    # NVFP4 ties with gs = 1: per 16-block amax = 6 * SF and elements m * SF
    # (m an e2m1 midpoint), exactly representable in bf16/f16.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    for sf_code in range(8, 127, 9):
        sf = float(torch.tensor(sf_code, dtype=torch.uint8).view(torch.float8_e4m3fn).to(F32))
        r = torch.zeros(hidden)
        for b in range(hidden // BLOCK):
            r[b * BLOCK] = 6.0 * sf
            for i in range(1, BLOCK):
                m = mids[(b + i) % len(mids)]
                r[b * BLOCK + i] = m * sf * (-1 if (i + b) % 2 else 1)
        rows.append(r)
    return torch.stack(rows).to(tdt)


def conversion_inputs(seed):
    """f32 values for the conversion tables: every bf16 value with magnitude in
    [2^-12, 520] and the midpoints between neighbours (the whole e4m3 and e2m1
    rounding range), and random f32 values below 65536 in magnitude."""
    b = torch.arange(0x3980, 0x4402, dtype=torch.int64)
    vals = (b << 16).to(torch.int32).view(F32)
    mids = ((b << 16) | 0x8000).to(torch.int32).view(F32)
    g = torch.Generator().manual_seed(seed)
    rnd = torch.randint(0, 0x47800000, (12288,), generator=g, dtype=torch.int64)
    near = rnd.to(torch.int32).view(F32)
    x = torch.cat([vals, mids, near, torch.tensor([0.0])])
    return torch.cat([x, -x])


# ------------------------------------------------------------------ writer
class Writer:
    def __init__(self):
        self.sets = []
        self.cases = []

    def add_set(self, name, dt, y):
        if y.dim() == 1:
            y = y.reshape(1, -1)
        assert bool(torch.isfinite(y.to(F32)).all()), f"set {name}: inputs must be finite"
        self.sets.append((name, dt, y.contiguous()))
        return len(self.sets) - 1

    def add_case(self, form, set_idx, param, quant, scales):
        q = quant.contiguous().view(torch.uint8).numpy().tobytes()
        s = b"" if scales is None else scales.contiguous().view(torch.uint8).numpy().tobytes()
        pbits = struct.unpack("<I", struct.pack("<f", param))[0]
        self.cases.append((FORMS[form], set_idx, pbits, q, s))

    def bytes(self):
        out = bytearray(b"ARFGOLD1")
        out += struct.pack("<I", len(self.sets))
        for name, dt, y in self.sets:
            nb = name.encode()
            out += struct.pack("<BBH", DTYPES[dt], 0, len(nb)) + nb
            out += struct.pack("<II", y.shape[0], y.shape[1])
            width = torch.int32 if dt == "f32" else torch.int16
            out += y.view(width).numpy().astype("<i4" if dt == "f32" else "<i2").tobytes()
        out += struct.pack("<I", len(self.cases))
        for form, idx, p, q, s in self.cases:
            out += struct.pack("<BBHII", form, 0, 0, idx, p)
            out += struct.pack("<I", len(q)) + q
            out += struct.pack("<I", len(s)) + s
        return bytes(out)


def add_quant_cases(w, dt, name, y, static_scales, global_scales, stats):
    idx = w.add_set(name, dt, y)
    yf = y.to(F32)
    for sc in static_scales:
        q, _ = fp8_static(yf, sc)
        w.add_case("fp8_static", idx, sc, q, None)
    q, s = fp8_per_token(yf)
    w.add_case("fp8_per_token", idx, 0.0, q, s)
    if yf.shape[1] % GROUP == 0:
        q, s = fp8_group_f32(yf)
        w.add_case("fp8_group_f32", idx, 0.0, q, s)
        q, s = fp8_group_f32_ue8m0(yf)
        w.add_case("fp8_group_f32_ue8m0", idx, 0.0, q, s)
        q, s = fp8_group_packed(yf)
        w.add_case("fp8_group_packed_ue8m0", idx, 0.0, q, s)
    if dt != "f32":
        for k, gs in enumerate(global_scales):
            q, sf = nvfp4(yf, gs, "fused")
            w.add_case("nvfp4_swizzled", idx, gs, q, swizzle(sf))
            if k == 0:
                w.add_case("nvfp4_linear", idx, gs, q, sf)
            q_ref, _ = nvfp4(yf, gs, "reference")
            stats["nvfp4 ref_fp4_quant order differs (bytes)"] = stats.get(
                "nvfp4 ref_fp4_quant order differs (bytes)", 0
            ) + int((q_ref != q).sum())
            stats["nvfp4 bytes compared"] = stats.get("nvfp4 bytes compared", 0) + q.numel()


def build(seed):
    w = Writer()
    stats = {}
    static_scales = [3.7, 1.0, 0.0123, 1.0 / 448.0, 0.5, 250.0]
    for dt in ["bf16", "f16"]:
        gs_list = [1.0, 448.0 * 6.0 / 37.5, 0.25, 1234.5678]
        every = all_finite(dt)
        add_quant_cases(w, dt, f"{dt} every finite value", every, static_scales[:4], gs_list, stats)
        add_quant_cases(
            w, dt, f"{dt} realistic", realistic(dt, 61, 640, seed), static_scales[:3], gs_list, stats
        )
        add_quant_cases(w, dt, f"{dt} edge rows", edge_rows(dt, 384), static_scales[:2], gs_list, stats)
    add_quant_cases(w, "f32", "f32 realistic", realistic("f32", 61, 512, seed + 1), static_scales, [], stats)
    add_quant_cases(w, "f32", "f32 edge rows", edge_rows("f32", 384), static_scales[:2], [], stats)

    x = conversion_inputs(seed + 2)
    idx = w.add_set("f32 conversion inputs", "f32", x)
    w.add_case("cvt_e4m3", idx, 0.0, e4m3_codes(x), None)
    w.add_case("cvt_e2m1", idx, 0.0, e2m1_codes(x), None)
    w.add_case("cvt_bf16", idx, 0.0, x.to(torch.bfloat16).view(torch.int16), None)
    w.add_case("cvt_f16", idx, 0.0, x.to(torch.float16).view(torch.int16), None)
    return w, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = pathlib.Path(__file__).resolve().parent
    default = here.parent.parent / "crates/reference/tests/golden/quant_engines.bin"
    ap.add_argument("--out", type=pathlib.Path, default=default)
    ap.add_argument("--seed", type=int, default=2024)
    args = ap.parse_args()
    torch.set_num_threads(1)
    w, stats = build(args.seed)
    data = w.bytes()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"wrote {args.out}: {len(data)} bytes, {len(w.sets)} input sets, {len(w.cases)} cases")
    for k, v in stats.items():
        print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
