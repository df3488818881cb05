// arfuse_host_probe.cpp -- C entry points of the host build's software `cvt`
// conversions, through the kernels' own helpers where they exist, so that
// crates/runtime/tests/host_numerics.rs can check every one of them exhaustively
// against arfuse-reference and `half`. Host build only (never given to NVRTC).
#define ARF_DTYPE ARF_DTYPE_F16  // f16: arf_bits_to_f32 / arf_f32_to_bits take the f16 path
#define ARF_QUANT ARF_Q_NVFP4_LINEAR  // an NVFP4 quant, so that arf_e2m1x2 exists
#include "arfuse_common.cuh"

#define ARF_PROBE extern "C" __attribute__((visibility("default")))

// cvt.rn.bf16.f32 (the body of arf_f32_to_bits for ARF_DTYPE 0).
ARF_PROBE unsigned arf_probe_f32_to_bf16(float f) { return arf_host::cvt_rn_bf16_f32(f); }
// cvt.rn.f16.f32 through arf_f32_to_bits.
ARF_PROBE unsigned arf_probe_f32_to_f16(float f) { return arf_f32_to_bits(f); }
// cvt.f32.f16 through arf_bits_to_f32.
ARF_PROBE float arf_probe_f16_to_f32(unsigned h) { return arf_bits_to_f32(h); }
// cvt.rn.satfinite.e4m3x2.f32 through arf_e4m3x2: `lo` in bits 0..8, `hi` in 8..16.
ARF_PROBE unsigned arf_probe_e4m3x2(float lo, float hi) { return arf_e4m3x2(lo, hi); }
// cvt.rn.satfinite.e2m1x2.f32 through arf_e2m1x2: `lo` in bits 0..4, `hi` in 4..8.
ARF_PROBE unsigned arf_probe_e2m1x2(float lo, float hi) { return arf_e2m1x2(lo, hi); }
// Exact value of an e4m3 byte, the kernels' arf_e4m3_to_f32 (NVFP4 block scales).
ARF_PROBE float arf_probe_e4m3_to_f32(unsigned b) { return arf_e4m3_to_f32(b); }
