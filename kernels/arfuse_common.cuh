// arfuse_common.cuh -- device helpers shared by every arfuse kernel.
//
// Compiled with NVRTC; no CUDA headers are included (bf16/f16/fp8/fp4 conversions use
// PTX `cvt` directly), so the same text compiles with NVRTC 12.x and 13.x and with the
// PyPI NVRTC wheel, which ships no include files. The same text is also compiled for the
// CPU (g++, C++20) with -DARF_HOST=1: every inline-PTX helper below then has a host body
// (the `#if defined(ARF_HOST)` branches), and arfuse_host.h supplies the CUDA built-ins
// and the executor (crates/runtime/src/host.rs). NVRTC never takes those branches.
//
// Compile-time configuration (set by crates/runtime/src/variants.rs as -D defines):
//   ARF_DTYPE    0 = bf16, 1 = f16, 2 = f32 (activation dtype T)
//   ARF_W        world size 2, 4, 8 or 16 (fused kernels only)
//   ARF_STRATEGY 1 = one-shot Lamport, 2 = two-shot (fused kernels only)
//   ARF_RESIDUAL 1 = add residual_in, 0 = no residual (h = all-reduce output)
//   ARF_NORM     1 = RMSNorm, 0 = none (y = h)
//   ARF_QUANT    0 none, 1 fp8 static, 2 fp8 per-token, 3 fp8 per-token-group (128)
//                packed ue8m0 column-major, 4 fp8 group fp32 row-major,
//                5 nvfp4 swizzled 128x4 scales, 6 nvfp4 linear scales (5/6: sm_100a+),
//                7 fp8 group fp32 row-major with power-of-two (ue8m0) values
// Which outputs are written is decided at run time: a null output pointer is dead.
//
// Rounding contract (crates/reference/src/contract.rs, the one definition):
//   s   = ((0.0f + x_0) + x_1) + ... + x_{W-1}   fp32, fixed rank order, starting from
//         +0.0 so that an all -0.0 column gives +0.0 on every strategy (the Lamport
//         transport replaces -0.0 by +0.0, which cannot change a sum that starts at +0)
//   a   = round_T(s)                              (the unfused all-reduce output)
//   h   = round_T(float(a) + float(residual))     -> residual_out
//   n   = float(h), or with p.norm_f32_sum the unrounded float(a) + float(residual)
//         (the contract's NormInput::F32Sum, vLLM's native fused_add_rms_norm); the
//         lines below read n where they say h. For f32 T the two are the same value,
//         and f32 builds compile only the first (the second spilled on sm_100a)
//   r   = 1.0f / sqrtf(sum_i(float(h_i)^2) / H + eps)   sum in fp32 in the block
//         tree of arf_block_sum over blockDim = arfuse_block_threads(H, e) threads
//         (the contract's SumOrder::KernelTree): it depends on H and e only, never
//         on T, the grid or the strategy, so one-shot, two-shot and the local kernel
//         give the same bits for a row in any batch; correctly rounded sqrt and
//         division (NVRTC defaults), no FMA (--fmad=false)
//   y   = round_T((float(h) * r) * (float(gamma) + weight_bias))   (one rounding;
//         gamma in T, or f32 when p.gamma_f32, the Gemma form 1 + w.float()), or
//         with p.norm_round_twice the Llama order
//         y = round_T(float(round_T(float(h) * r)) * (float(gamma) + weight_bias))
//         (the contract's NormRounding::Twice)
//   quant applied to float(y), in the operation order of contract clause 4 (see the
//   quant part of arf_epilogue; crates/reference/src/contract.rs names the sources).
#pragma once

#if defined(ARF_HOST)
#include "arfuse_host.h"
#endif

#ifndef ARF_DTYPE
#error "ARF_DTYPE must be defined"
#endif
#ifndef ARF_RESIDUAL
#define ARF_RESIDUAL 1
#endif
#ifndef ARF_NORM
#define ARF_NORM 1
#endif
#ifndef ARF_QUANT
#define ARF_QUANT 0
#endif
// Every number these kernels are built for comes from the ABI (crates/abi,
// arfuse_abi::kernel_defines), passed as -D defines to NVRTC and to the host compiler
// alike; this text holds no second copy (crates/runtime/tests/kernel_abi.rs greps it):
//   ARF_MAX_RANKS, ARF_WORLD_MASK     peers a call holds, the world sizes built
//   ARF_MAX_VPT                       16-byte vectors per thread per token, held in
//                                     registers between the two RMSNorm passes (every
//                                     variant is checked for zero spills at that cap,
//                                     crates/runtime/tests/kernels_compile.rs)
//   ARF_VECTOR_BYTES, ARF_MAX_BLOCK_THREADS
//   ARF_FP8_GROUP, ARF_NVFP4_BLOCK, ARF_NVFP4_TILE_ROWS, ARF_NVFP4_TILE_COLS
//   ARF_LAMPORT_BUFFERS               Lamport buffers that rotate
//   ARF_DTYPE_*, ARF_Q_*, ARF_ONE_SHOT, ARF_TWO_SHOT   the values of ARF_DTYPE,
//                                     ARF_QUANT and ARF_STRATEGY
#if !defined(ARF_MAX_RANKS) || !defined(ARF_MAX_VPT) || !defined(ARF_Q_NONE) || !defined(ARF_DTYPE_F32)
#error "the ABI's defines are missing: compile with arfuse_abi::kernel_defines()"
#endif

#if ARF_DTYPE == ARF_DTYPE_F32
#define ARF_EB 4
#else
#define ARF_EB 2
#endif
// Elements per 16-byte vector.
#define ARF_VEC (ARF_VECTOR_BYTES / ARF_EB)

#if (ARF_QUANT == ARF_Q_NVFP4_SWIZZLED || ARF_QUANT == ARF_Q_NVFP4_LINEAR) && ARF_DTYPE == ARF_DTYPE_F32
#error "NVFP4 quant is defined for 16-bit activations only"
#endif

typedef unsigned int u32;
typedef unsigned long long u64;

// The Lamport buffers as an unsigned count (call n uses buffer n % ARF_NBUF).
#define ARF_NBUF ((u32)ARF_LAMPORT_BUFFERS)

// Error word bits (the kernel exits instead of hanging and sets them): ARF_ERR_* from
// the ABI (arfuse_abi::protocol), as are the state words ARF_STATE_* and the call
// header's fields ARF_HDR_*.

// A tensor addressed per rank: rank r's data starts at ptr + r * rank_stride (bytes).
// Virtual ranks on one GPU use rank_stride = bytes of one rank's tensor; a real rank
// (one process per GPU) passes its own pointer with rank_stride = 0.
struct ArfTensor {
  u64 ptr;
  u64 rank_stride;
};

// Kernel parameters, passed by value. Mirrored by `KernelParams` in
// crates/runtime/src/device.rs (repr(C)); both sides assert the size.
struct ArfParams {
  // Byte address of every rank's workspace as seen from the launching GPU: one
  // allocation with W slices for virtual ranks, IPC / multicast-unicast mappings for
  // real peers. The kernels never care which.
  u64 peer[ARF_MAX_RANKS];
  ArfTensor x;             // [T, H] T: this rank's all-reduce input (local kernel: input)
  ArfTensor residual_in;   // [T, H] T
  ArfTensor residual_out;  // [T, H] T, or 0 = dead
  ArfTensor out;           // [T, H] T: norm_out (ARF_NORM=1) or all-reduce output; 0 = dead
  ArfTensor quant_out;     // fp8 [T, H] or nvfp4 [T, H/2] bytes; 0 = dead
  ArfTensor scale_out;     // per-token / per-group / nvfp4 block scales
  u64 gamma;               // [H] T (or f32 when gamma_f32), shared by all ranks
  u64 scale_in;            // fp32[1]: static fp8 dequant scale or nvfp4 global scale
  u64 off_state;           // workspace offsets (bytes), identical on every rank:
  u64 off_lamport;         //   arfuse_policy::ArfuseLayout
  u64 lamport_stride;      // bytes of ONE Lamport buffer (3 rotate)
  u64 err;                 // device address of a u32 error word
  u64 timeout_ns;          // polling gives up after this long (globaltimer ns)
  int T;                   // tokens of this call
  int H;                   // hidden size (elements)
  int rank_base;           // rank of blockIdx.y == 0
  float eps;
  float weight_bias;       // 0 or 1 (Gemma-style norm weight stored as an offset)
  int gamma_f32;           // 1: gamma is f32 (Gemma's 1 + w.float()); 0: gamma is T
  int norm_round_twice;    // 1: round h * r to T before the weight multiply (Llama order)
  int norm_f32_sum;        // 1: normalise the unrounded f32 sum a + residual (ARF_RESIDUAL)
  u32 call_tag;            // the caller's tag of this call (its fused site), in the call header
  // scale_out holds the scales of `scale_rows` tokens (the caller's whole tensor, in
  // its layout), and this call's token t is row scale_row0 + t of it: a T split into
  // several calls writes one packed-UE8M0 or swizzled-NVFP4 tensor, whose layouts
  // depend on the whole T. quant_out and the other outputs are offset by the caller.
  int scale_row0;
  int scale_rows;
};
static_assert(sizeof(ArfParams) == 328, "ArfParams layout changed: update KernelParams in crates/runtime/src/device.rs");

// ---------------------------------------------------------------- conversions
__device__ __forceinline__ float arf_bits_to_f32(u32 b) {
#if ARF_DTYPE == ARF_DTYPE_BF16
  return __uint_as_float(b << 16);
#elif ARF_DTYPE == ARF_DTYPE_F16
#if defined(ARF_HOST)
  return arf_host::cvt_f32_f16((unsigned short)b);
#else
  float f;
  unsigned short h = (unsigned short)b;
  asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
  return f;
#endif
#else
  return __uint_as_float(b);
#endif
}

// Round to nearest even into the activation dtype; returns the bit pattern.
__device__ __forceinline__ u32 arf_f32_to_bits(float f) {
#if ARF_DTYPE == ARF_DTYPE_BF16 && defined(ARF_HOST)
  return arf_host::cvt_rn_bf16_f32(f);
#elif ARF_DTYPE == ARF_DTYPE_BF16
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#elif ARF_DTYPE == ARF_DTYPE_F16 && defined(ARF_HOST)
  return arf_host::cvt_rn_f16_f32(f);
#elif ARF_DTYPE == ARF_DTYPE_F16
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return __float_as_uint(f);
#endif
}

__device__ __forceinline__ void arf_unpack(const uint4 v, float (&f)[ARF_VEC]) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#if ARF_EB == 2
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = arf_bits_to_f32(w[i] & 0xffffu);
    f[2 * i + 1] = arf_bits_to_f32(w[i] >> 16);
  }
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(w[i]);
#endif
}

__device__ __forceinline__ uint4 arf_pack(const float (&f)[ARF_VEC]) {
  u32 w[4];
#if ARF_EB == 2
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = arf_f32_to_bits(f[2 * i]) | (arf_f32_to_bits(f[2 * i + 1]) << 16);
#else
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(f[i]);
#endif
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---------------------------------------------------------------- Lamport sentinel
// The "empty" value is -0.0 tested BITWISE (0x8000 / 0x80000000): a float compare
// would also match negative subnormals flushed to zero and hang forever.
#if ARF_EB == 2
#define ARF_SENTINEL_WORD 0x80008000u
__device__ __forceinline__ bool arf_word_ready(u32 w) {
  return (w & 0xffffu) != 0x8000u && (w >> 16) != 0x8000u;
}
__device__ __forceinline__ u32 arf_word_scrub(u32 w) {
  if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
  if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
  return w;
}
#else
#define ARF_SENTINEL_WORD 0x80000000u
__device__ __forceinline__ bool arf_word_ready(u32 w) { return w != 0x80000000u; }
__device__ __forceinline__ u32 arf_word_scrub(u32 w) { return w == 0x80000000u ? 0u : w; }
#endif

__device__ __forceinline__ bool arf_vec_ready(const uint4 v) {
  return arf_word_ready(v.x) && arf_word_ready(v.y) && arf_word_ready(v.z) && arf_word_ready(v.w);
}
__device__ __forceinline__ uint4 arf_vec_scrub(const uint4 v) {
  return make_uint4(arf_word_scrub(v.x), arf_word_scrub(v.y), arf_word_scrub(v.z), arf_word_scrub(v.w));
}

// ---------------------------------------------------------------- memory operations
__device__ __forceinline__ uint4 arf_ld(u64 addr) {
  return *reinterpret_cast<const uint4*>(addr);
}
__device__ __forceinline__ void arf_st(u64 addr, uint4 v) {
#if defined(ARF_HOST)
  arf_host::chaos_point();
#endif
  *reinterpret_cast<uint4*>(addr) = v;
}
// Loads of data another rank (possibly another GPU) writes: volatile = relaxed at
// system scope, never served from a stale L1 line.
__device__ __forceinline__ uint4 arf_ld_sys(u64 addr) {
#if defined(ARF_HOST)
  return arf_host::ld_relaxed_v4(addr);
#else
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(addr)
               : "memory");
  return v;
#endif
}
// Stores to another rank's memory (relaxed, system scope). The Lamport data is its own
// flag (an element is written once it is not the sentinel), so no store needs ordering
// against another of the same call; across calls the kernel boundaries order them
// ("Fences" in allreduce_fused.cu).
__device__ __forceinline__ void arf_st_sys(u64 addr, uint4 v) {
#if defined(ARF_HOST)
  arf_host::st_relaxed_v4(addr, v);
#else
  asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
#endif
}
// Asks for the 128-byte line at `addr` to be brought into L2 (no register, no wait):
// the residual and weight a token's epilogue reads, issued before the token's polling
// so the loads after it hit L2. A hint only; the host build has no caches to fill.
__device__ __forceinline__ void arf_prefetch_l2(u64 addr) {
#if defined(ARF_HOST)
  (void)addr;
#else
  asm volatile("prefetch.global.L2 [%0];" ::"l"(addr));
#endif
}
__device__ __forceinline__ void arf_st_release_sys(u64 addr, u32 v) {
#if defined(ARF_HOST)
  arf_host::chaos_point();
  arf_host::store_release(addr, v);
#else
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
#endif
}
__device__ __forceinline__ u32 arf_ld_acquire_sys(u64 addr) {
#if defined(ARF_HOST)
  return arf_host::load_acquire(addr);
#else
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
#endif
}
__device__ __forceinline__ u32 arf_ld_volatile_u32(u64 addr) {
#if defined(ARF_HOST)
  return arf_host::load_relaxed(addr);
#else
  u32 v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
#endif
}
__device__ __forceinline__ u64 arf_globaltimer() {
#if defined(ARF_HOST)
  return arf_host::globaltimer();
#else
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// ---------------------------------------------------------------- PDL
// Wait for the previous kernel in the stream (no-op without the PDL attribute).
__device__ __forceinline__ void arf_grid_dependency_wait() {
#if !defined(ARF_HOST)  // host: launches are ordered by the launcher, PDL does not exist
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Let the next kernel launch. Called only after the last store of the CTA, so
// completion is always signalled at the end (domain.md section 4: early signalling
// let a dependent read an unwritten buffer).
__device__ __forceinline__ void arf_trigger_dependents() {
#if !defined(ARF_HOST)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---------------------------------------------------------------- thread index
// threadIdx.x read by a volatile asm, so that NVVM cannot hoist what is derived from it
// (the vector indices threadIdx.x + v * blockDim.x of the ARF_MAX_VPT unrolled
// vectors, their 64-bit byte offsets, the lane and warp of the block reductions) out
// of the token loop and keep it in registers across every token; ptxas sees a fresh
// S2R each time and in practice recomputes too. Those hoisted values (with the
// one-shot buffer indices and the two-shot epoch, now re-read from shared memory),
// live next to a[] through the IEEE-division slow-path calls of the epilogue, were
// what spilled at the 64-register cap of 1024-thread blocks. Recomputing costs a few
// integer instructions per pass; no floating-point operation changes.
__device__ __forceinline__ int arf_tid() {
#if defined(ARF_HOST)
  return (int)threadIdx.x;
#else
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
#endif
}
// Index of this thread's vector v of a token (see arf_tid).
__device__ __forceinline__ int arf_vec_idx(int v) { return arf_tid() + v * (int)blockDim.x; }

// ---------------------------------------------------------------- reductions
// Blocks are a multiple of 32 threads (>= 128), so every warp is full and the
// full-mask shuffles below are valid: no sub-warp block reductions exist.
__device__ __forceinline__ float arf_block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int tid = arf_tid(), lane = tid & 31, warp = tid >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = (lane < (int)(blockDim.x >> 5)) ? red[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float arf_block_max(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int tid = arf_tid(), lane = tid & 31, warp = tid >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = (lane < (int)(blockDim.x >> 5)) ? red[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Max over `width` consecutive lanes (width a power of two <= 32).
__device__ __forceinline__ float arf_group_max(float v, int width) {
  for (int o = width >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---------------------------------------------------------------- quant helpers
// e4m3 (fp8) with satfinite, round to nearest even: two values -> two bytes
// (`lo` in the low byte).
__device__ __forceinline__ u32 arf_e4m3x2(float lo, float hi) {
#if defined(ARF_HOST)
  return arf_host::cvt_rn_satfinite_e4m3_f32(lo) | (arf_host::cvt_rn_satfinite_e4m3_f32(hi) << 8);
#else
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}
// One vector of ARF_VEC activations -> ARF_VEC e4m3 bytes at `dst`:
// e4m3(clamp(y / scale, -448, 448)), as contract clause 4 (a true division). The
// clamp is the cvt's satfinite: it saturates every finite value and infinity to
// +-448 exactly as a clamp would, and keeps NaN a NaN (0x7F), which an fminf/fmaxf
// clamp would turn into -448.
__device__ __forceinline__ void arf_store_e4m3_vec(u64 dst, const float* yf, float scale) {
  u32 b[ARF_VEC / 2];
#pragma unroll
  for (int i = 0; i < ARF_VEC; i += 2) b[i / 2] = arf_e4m3x2(yf[i] / scale, yf[i + 1] / scale);
#if ARF_VEC == 8
  *reinterpret_cast<uint2*>(dst) = make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
#else
  *reinterpret_cast<u32*>(dst) = b[0] | (b[1] << 16);
#endif
}
// As arf_store_e4m3_vec with e4m3(y * inv): static FP8 multiplies by the rounded
// reciprocal of its scale (contract clause 4).
__device__ __forceinline__ void arf_store_e4m3_vec_mul(u64 dst, const float* yf, float inv) {
  u32 b[ARF_VEC / 2];
#pragma unroll
  for (int i = 0; i < ARF_VEC; i += 2) b[i / 2] = arf_e4m3x2(yf[i] * inv, yf[i + 1] * inv);
#if ARF_VEC == 8
  *reinterpret_cast<uint2*>(dst) = make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
#else
  *reinterpret_cast<u32*>(dst) = b[0] | (b[1] << 16);
#endif
}
// Exact value of an e4m3 byte (finite inputs only; satfinite never produces NaN).
__device__ __forceinline__ float arf_e4m3_to_f32(u32 b) {
  const u32 e = (b >> 3) & 15u, m = b & 7u;
  const float mag = e == 0 ? (float)m * 0.001953125f /* 2^-9 */
                           : __uint_as_float(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) ? -mag : mag;
}
#if ARF_QUANT == ARF_Q_NVFP4_SWIZZLED || ARF_QUANT == ARF_Q_NVFP4_LINEAR
// e2m1 (fp4) pair with satfinite, round to nearest even: `lo` in the low nibble.
// The cvt needs sm_100a or later.
__device__ __forceinline__ u32 arf_e2m1x2(float lo, float hi) {
#if defined(ARF_HOST)
  return arf_host::cvt_rn_satfinite_e2m1_f32(lo) | (arf_host::cvt_rn_satfinite_e2m1_f32(hi) << 4);
#else
  u32 r;
  asm("{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, %1, %2; cvt.u32.u8 %0, t; }"
      : "=r"(r)
      : "f"(hi), "f"(lo));
  return r;
#endif
}
#endif
// Byte offset of the NVFP4 scale of (row t, 16-element block column c) in the
// swizzled 128x4 layout (cuBLAS / FlashInfer convention): 512-byte tiles of 128 rows x
// 4 columns, tiles ordered row-tile major; inside a tile row i sits at
// (i % 32) * 16 + (i / 32) * 4 and column c % 4 adds c % 4.
__device__ __forceinline__ u64 arf_nvfp4_sf_offset(int t, int c, int sf_cols) {
  const int ktiles = (sf_cols + ARF_NVFP4_TILE_COLS - 1) / ARF_NVFP4_TILE_COLS;
  return ((u64)(t / ARF_NVFP4_TILE_ROWS) * ktiles + (u64)(c / ARF_NVFP4_TILE_COLS)) *
             (u64)(ARF_NVFP4_TILE_ROWS * ARF_NVFP4_TILE_COLS) +
         (u64)(t % 32) * 16u + (u64)((t % ARF_NVFP4_TILE_ROWS) / 32) * 4u + (u64)(c % ARF_NVFP4_TILE_COLS);
}

__device__ __forceinline__ u64 arf_rank_ptr(const ArfTensor& a, int rank) {
  return a.ptr == 0 ? 0 : a.ptr + (u64)rank * a.rank_stride;
}

// The RMSNorm weight of vector `idx` (ARF_VEC elements): in T (one 16-byte load) or,
// when p.gamma_f32, in f32 (ARF_VEC * 4 bytes).
__device__ __forceinline__ void arf_load_gamma(const ArfParams& p, int idx, float (&g)[ARF_VEC]) {
#if ARF_DTYPE == ARF_DTYPE_F32
  arf_unpack(arf_ld(p.gamma + (u64)idx * (u64)ARF_VECTOR_BYTES), g);
#else
  if (p.gamma_f32) {
#pragma unroll
    for (int k = 0; k < ARF_VEC / 4; ++k) {
      const uint4 w = arf_ld(p.gamma + (u64)idx * (ARF_VEC * 4u) + (u64)k * (u64)ARF_VECTOR_BYTES);
      g[4 * k + 0] = __uint_as_float(w.x);
      g[4 * k + 1] = __uint_as_float(w.y);
      g[4 * k + 2] = __uint_as_float(w.z);
      g[4 * k + 3] = __uint_as_float(w.w);
    }
  } else {
    arf_unpack(arf_ld(p.gamma + (u64)idx * (u64)ARF_VECTOR_BYTES), g);
  }
#endif
}

// ---------------------------------------------------------------- epilogue
// Runs on one token `t` of rank `rank` whose all-reduced values (already rounded to
// T) are in a[0..vpt) (vector v of this thread is idx = arf_vec_idx(v)).
// Every thread of the block calls it (block reductions inside).
__device__ __forceinline__ void arf_epilogue(const ArfParams& p, int rank, int t, uint4 (&a)[ARF_MAX_VPT],
                                             int vpt, int nvec, float* red) {
  const u64 row = (u64)t * (u64)p.H * ARF_EB;
  const u64 res_out = arf_rank_ptr(p.residual_out, rank);
  const u64 out = arf_rank_ptr(p.out, rank);
#if ARF_RESIDUAL
  const u64 res_in = arf_rank_ptr(p.residual_in, rank);
#endif
#if ARF_NORM
  float ss = 0.0f;
#endif
#pragma unroll
  for (int v = 0; v < ARF_MAX_VPT; ++v) {
    const int idx = arf_vec_idx(v);
    if (v < vpt && idx < nvec) {
#if ARF_RESIDUAL
      float af[ARF_VEC], rf[ARF_VEC];
      arf_unpack(a[v], af);
      arf_unpack(arf_ld(res_in + row + (u64)idx * (u64)ARF_VECTOR_BYTES), rf);
#pragma unroll
      for (int i = 0; i < ARF_VEC; ++i) af[i] = af[i] + rf[i];
#if ARF_NORM && ARF_DTYPE != ARF_DTYPE_F32
      // For f32 T, rounding the f32 sum is the identity: both norm inputs are one path.
      if (p.norm_f32_sum) {
        // The norm reads the unrounded sum: a[v] keeps the all-reduce output, and the
        // second pass adds the residual again (and only then writes residual_out, so
        // that a residual_out aliasing residual_in is read before it is written).
#pragma unroll
        for (int i = 0; i < ARF_VEC; ++i) ss += af[i] * af[i];
        continue;
      }
#endif
      a[v] = arf_pack(af);
#endif
      if (res_out) arf_st(res_out + row + (u64)idx * (u64)ARF_VECTOR_BYTES, a[v]);
#if ARF_NORM
      float hf[ARF_VEC];
      arf_unpack(a[v], hf);
#pragma unroll
      for (int i = 0; i < ARF_VEC; ++i) ss += hf[i] * hf[i];
#endif
    }
  }
#if ARF_NORM
  ss = arf_block_sum(ss, red);
  const float rstd = 1.0f / sqrtf(ss / (float)p.H + p.eps);
#pragma unroll
  for (int v = 0; v < ARF_MAX_VPT; ++v) {
    const int idx = arf_vec_idx(v);
    if (v < vpt && idx < nvec) {
      float hf[ARF_VEC], gf[ARF_VEC];
      arf_unpack(a[v], hf);
#if ARF_RESIDUAL && ARF_DTYPE != ARF_DTYPE_F32
      if (p.norm_f32_sum) {
        float rf[ARF_VEC];
        arf_unpack(arf_ld(res_in + row + (u64)idx * (u64)ARF_VECTOR_BYTES), rf);
#pragma unroll
        for (int i = 0; i < ARF_VEC; ++i) hf[i] = hf[i] + rf[i];
        if (res_out) arf_st(res_out + row + (u64)idx * (u64)ARF_VECTOR_BYTES, arf_pack(hf));
      }
#endif
      arf_load_gamma(p, idx, gf);
#pragma unroll
      for (int i = 0; i < ARF_VEC; ++i) {
        float n = hf[i] * rstd;
        if (p.norm_round_twice) n = arf_bits_to_f32(arf_f32_to_bits(n));
        hf[i] = n * (gf[i] + p.weight_bias);
      }
      a[v] = arf_pack(hf);
    }
  }
#endif
  if (out) {
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      if (v < vpt && idx < nvec) arf_st(out + row + (u64)idx * (u64)ARF_VECTOR_BYTES, a[v]);
    }
  }
#if ARF_QUANT != ARF_Q_NONE
  const u64 qout = arf_rank_ptr(p.quant_out, rank);
  const u64 sout = arf_rank_ptr(p.scale_out, rank);
#endif
#if ARF_QUANT == ARF_Q_FP8_STATIC || ARF_QUANT == ARF_Q_FP8_TOKEN
#if ARF_QUANT == ARF_Q_FP8_STATIC
  // q = e4m3_satfinite(y * (1 / scale)), scale = fp32 dequant scale: the reciprocal
  // rounded once, then a product (vLLM static_scaled_fp8_quant, FlashInfer pattern 2).
  const float qinv = 1.0f / *reinterpret_cast<const float*>(p.scale_in);
#else
  // scale_t = max(amax_t / 448, 1 / (512 * 448)); q = e4m3(clamp(y / scale_t)).
  float amax = 0.0f;
#pragma unroll
  for (int v = 0; v < ARF_MAX_VPT; ++v) {
    const int idx = arf_vec_idx(v);
    if (v < vpt && idx < nvec) {
      float yf[ARF_VEC];
      arf_unpack(a[v], yf);
#pragma unroll
      for (int i = 0; i < ARF_VEC; ++i) amax = fmaxf(amax, fabsf(yf[i]));
    }
  }
  amax = arf_block_max(amax, red);
  const float qscale = fmaxf(amax / 448.0f, 1.0f / (512.0f * 448.0f));
  if (threadIdx.x == 0 && sout) *reinterpret_cast<float*>(sout + (u64)(p.scale_row0 + t) * 4u) = qscale;
#endif
  if (qout) {
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      if (v < vpt && idx < nvec) {
        float yf[ARF_VEC];
        arf_unpack(a[v], yf);
#if ARF_QUANT == ARF_Q_FP8_STATIC
        arf_store_e4m3_vec_mul(qout + (u64)t * (u64)p.H + (u64)idx * ARF_VEC, yf, qinv);
#else
        arf_store_e4m3_vec(qout + (u64)t * (u64)p.H + (u64)idx * ARF_VEC, yf, qscale);
#endif
      }
    }
  }
#elif ARF_QUANT == ARF_Q_FP8_GROUP_PACKED || ARF_QUANT == ARF_Q_FP8_GROUP_F32 || \
    ARF_QUANT == ARF_Q_FP8_GROUP_F32_UE8M0
  // Groups of 128 elements = 128 / ARF_VEC consecutive vectors = that many
  // consecutive lanes of one warp (blockDim is a multiple of 32, so a group never
  // straddles two warps or two v iterations). H % 128 == 0 is checked on the host.
  const int gw = ARF_FP8_GROUP / ARF_VEC;
  const int groups = p.H / ARF_FP8_GROUP;
#pragma unroll
  for (int v = 0; v < ARF_MAX_VPT; ++v) {
    if (v < vpt) {  // uniform across the block
      const int idx = arf_vec_idx(v);
      const bool live = idx < nvec;
      float amax = 0.0f;
      if (live) {
        float yf[ARF_VEC];
        arf_unpack(a[v], yf);
#pragma unroll
        for (int i = 0; i < ARF_VEC; ++i) amax = fmaxf(amax, fabsf(yf[i]));
      }
      amax = arf_group_max(amax, gw);
      // Contract v2 clause 4 (vLLM's per_token_group_quant kernels): the f32 form's
      // scale is max(amax, 1e-10) / 448; the UE8M0 forms floor that at 1e-10 and round
      // it up to a power of two (exponent + 1 when the mantissa is not zero).
      const float raw = fmaxf(amax, 1e-10f) / 448.0f;
#if ARF_QUANT == ARF_Q_FP8_GROUP_F32
      const float gscale = raw;
#else
      // The largest code is 254 (2^127): 255 is UE8M0's NaN (an infinite amax).
      const u32 rb = __float_as_uint(fmaxf(raw, 1e-10f));
      u32 ex = rb >> 23;
      if (rb & 0x7fffffu) ex += 1u;
      ex = ex > 254u ? 254u : ex;
      const float gscale = __uint_as_float(ex << 23);
#endif
      if (live) {
        const int g = idx / gw;
        if ((idx % gw) == 0 && sout) {
#if ARF_QUANT == ARF_Q_FP8_GROUP_PACKED
          // int32 words column-major over the layout's tokens padded to 4: word
          // (g/4) * Tpad + row, byte g % 4. Unused bytes of the last word:
          // arf_zero_scale_padding.
          const u64 tpad = ((u64)p.scale_rows + 3u) & ~3ull;
          const u64 word = (u64)(g / 4) * tpad + (u64)(p.scale_row0 + t);
          unsigned char* w8 = reinterpret_cast<unsigned char*>(sout + word * 4u);
          w8[g % 4] = (unsigned char)ex;
#else
          reinterpret_cast<float*>(sout)[(u64)(p.scale_row0 + t) * groups + g] = gscale;
#endif
        }
        if (qout) {
          float yf[ARF_VEC];
          arf_unpack(a[v], yf);
          arf_store_e4m3_vec(qout + (u64)t * (u64)p.H + (u64)idx * ARF_VEC, yf, gscale);
        }
      }
    }
  }
#elif ARF_QUANT == ARF_Q_NVFP4_SWIZZLED || ARF_QUANT == ARF_Q_NVFP4_LINEAR
  // Blocks of 16 elements = 2 vectors = 2 adjacent lanes. H % 16 == 0 (host check).
  // Contract v2 clause 4, FlashInfer's fused order (cvt_warp_fp16_to_fp4):
  // SF = e4m3(gs * (amax * f32(1/6))); os = gs / float(SF), 0 when SF == 0;
  // q = e2m1(y * os). 1.0f / 6.0f folds at compile time to 0x3E2AAAAB.
  const float gs = *reinterpret_cast<const float*>(p.scale_in);
  const int sf_cols = p.H / ARF_NVFP4_BLOCK;
#pragma unroll
  for (int v = 0; v < ARF_MAX_VPT; ++v) {
    if (v < vpt) {
      const int idx = arf_vec_idx(v);
      const bool live = idx < nvec;
      float amax = 0.0f;
      if (live) {
        float yf[ARF_VEC];
        arf_unpack(a[v], yf);
#pragma unroll
        for (int i = 0; i < ARF_VEC; ++i) amax = fmaxf(amax, fabsf(yf[i]));
      }
      amax = arf_group_max(amax, 2);
      const u32 sf = arf_e4m3x2(gs * (amax * (1.0f / 6.0f)), 0.0f) & 0xffu;
      const float sff = arf_e4m3_to_f32(sf);
      const float os = sff != 0.0f ? gs / sff : 0.0f;
      if (live) {
        const int c = idx / 2;
        if ((idx & 1) == 0 && sout) {
#if ARF_QUANT == ARF_Q_NVFP4_SWIZZLED
          reinterpret_cast<unsigned char*>(sout)[arf_nvfp4_sf_offset(p.scale_row0 + t, c, sf_cols)] = (unsigned char)sf;
#else
          reinterpret_cast<unsigned char*>(sout)[(u64)(p.scale_row0 + t) * sf_cols + c] = (unsigned char)sf;
#endif
        }
        if (qout) {
          float yf[ARF_VEC];
          arf_unpack(a[v], yf);
          u32 packed = 0;
#pragma unroll
          for (int i = 0; i < ARF_VEC; i += 2) {
            // SF == 0: os = 0, a zero with the sign of y.
            packed |= arf_e2m1x2(yf[i] * os, yf[i + 1] * os) << (4 * i);
          }
          *reinterpret_cast<u32*>(qout + (u64)t * (u64)(p.H / 2) + (u64)idx * 4u) = packed;
        }
      }
    }
  }
#endif
}

// Zeroes the padding of the scale layouts that have one, for a call that writes rows
// [row0, row0 + T) of a layout of `rows` tokens (ArfParams::scale_row0, scale_rows).
// Packed ue8m0 group scales (rows + (C - 1) * round_up(rows, 4) words, vLLM's
// allocation, C = ceil(H / 512)): tokens [rows, round_up(rows, 4)) of every word column
// but the last (the last has `rows` rows only; writing its padding rows would pass the
// end of the caller's tensor), written by the call that ends the layout, and the
// unused bytes of the last column in this call's rows when (H/128) % 4 != 0. Swizzled
// NVFP4: rows [rows, round_up(rows, 128)) (by the call that ends the layout) and
// columns [H/16, round_up(H/16, 4)) of this call's rows. Every CTA of the rank
// calls it and writes its share (element k of the padding goes to global thread k of
// the grid, strided by the grid's threads: about 130 KB at H = 16,384, T = 1 were one
// CTA's work). Takes scalars (not the parameter struct) and is not inlined, so it adds
// no stack or register pressure. The bytes are disjoint from the scales the epilogue
// writes (a packed word's used bytes versus its unused ones), so no ordering is needed.
__device__ __noinline__ void arf_zero_scale_padding(u64 sout, int row0, int T, int rows, int H) {
  if (sout == 0) return;
  const u32 first = blockIdx.x * blockDim.x + threadIdx.x;
  const u32 step = gridDim.x * blockDim.x;
  const bool ends = row0 + T == rows;
#if ARF_QUANT == ARF_Q_FP8_GROUP_PACKED
  const u32 groups = (u32)H / (u32)ARF_FP8_GROUP;
  const u32 tpad = ((u32)rows + 3u) & ~3u;
  const u32 cols = (groups + 3u) / 4u;
  const u32 pad = ends ? tpad - (u32)rows : 0u;
  u32* w = reinterpret_cast<u32*>(sout);
  for (u32 k = first; k < (cols - 1u) * pad; k += step) w[(u64)(k / pad) * tpad + rows + k % pad] = 0u;
  if (groups % 4u != 0u) {
    unsigned char* b = reinterpret_cast<unsigned char*>(sout);
    const u32 used = groups % 4u;
    for (u32 t = first; t < (u32)T; t += step)
      for (u32 k = used; k < 4u; ++k) b[((u64)(cols - 1u) * tpad + (u32)row0 + t) * 4u + k] = 0;
  }
#elif ARF_QUANT == ARF_Q_NVFP4_SWIZZLED
  const int sf_cols = H / ARF_NVFP4_BLOCK;
  const int rows_pad = ((rows + ARF_NVFP4_TILE_ROWS - 1) / ARF_NVFP4_TILE_ROWS) * ARF_NVFP4_TILE_ROWS;
  const int cols_pad = ((sf_cols + ARF_NVFP4_TILE_COLS - 1) / ARF_NVFP4_TILE_COLS) * ARF_NVFP4_TILE_COLS;
  unsigned char* s8 = reinterpret_cast<unsigned char*>(sout);
  const int pad_rows = ends ? rows_pad - rows : 0;
  for (int k = (int)first; k < pad_rows * cols_pad; k += (int)step)
    s8[arf_nvfp4_sf_offset(rows + k / cols_pad, k % cols_pad, sf_cols)] = 0;
  const int extra = cols_pad - sf_cols;
  for (int k = (int)first; k < T * extra; k += (int)step)
    s8[arf_nvfp4_sf_offset(row0 + k / extra, sf_cols + k % extra, sf_cols)] = 0;
#else
  (void)row0;
  (void)T;
  (void)rows;
  (void)H;
  (void)first;
  (void)step;
  (void)ends;
#endif
}
