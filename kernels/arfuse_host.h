// arfuse_host.h -- the CUDA built-ins the arfuse kernels use, for a host (CPU) build of
// the SAME kernel sources (g++ 12, C++20), and the executor of one CTA.
//
// Included by arfuse_common.cuh when ARF_HOST is defined (crates/runtime/src/host.rs
// compiles every variant with the defines variants.rs gives NVRTC plus -DARF_HOST=1).
// NVRTC never sees this file. The inline PTX of the kernels stays behind the arf_*
// helpers of arfuse_common.cuh; each helper has a host body that calls into this file.
//
// Execution model (exact, not approximate):
// - One OS thread runs one CTA (the Rust launcher starts one per CTA, all CTAs of a
//   launch at once). The CUDA threads of the CTA are cooperative fibers on that OS
//   thread, so `__shared__` (static thread_local: one instance per OS thread, i.e. per
//   CTA) is shared by exactly the threads of the block, and a fiber only ever gives up
//   the CPU at a synchronisation point: __syncthreads, a warp shuffle, or a spin-wait
//   poll (arf_poll_expired). Between those points a CUDA thread runs alone, which every
//   interleaving of a real GPU allows.
// - __syncthreads: a fiber blocks until every thread of the block arrived at the SAME
//   call site (a divergent barrier is undefined in CUDA and reported as an error); a
//   barrier after some thread exited, or one that can never complete, is an error too.
// - __shfl_xor_sync: warp-synchronous: each lane publishes its value, blocks until the
//   32 lanes of its warp arrived, then reads its partner's value (double-buffered per
//   warp, so one barrier per shuffle suffices). Only the full mask and width 32 exist in
//   the kernels; anything else is reported.
// - Spin-waits yield the fiber; when a whole pass over the block made no progress (every
//   runnable fiber only polled), the OS thread yields, then sleeps with a bounded backoff
//   (so the other CTAs, each an OS thread, get the cores).
// - Order of fibers in each pass: ascending, or a seeded random permutation per pass
//   (ArfHostCta::seed != 0), so results cannot depend on one fixed interleaving.
// - Chaos (ArfHostCta::chaos): seeded pauses of the whole CTA at global stores and
//   fences, so that another CTA or rank can act between any two stores of a thread.
//
// Memory model: loads and stores at system scope are C++ atomics on 32-bit words with
// the PTX orderings (relaxed / release / acquire; a v4 access is four 32-bit accesses,
// as PTX defines vector accesses), fences are C++ fences (acq_rel, seq_cst for
// __threadfence); all written with GCC's __atomic builtins, the C++ memory model's
// primitives (see the includes below for why not <atomic>). On x86-64 the
// hardware is stronger than PTX (TSO), so the host run shows the kernels' logic under
// every schedule the executor produces, not weak-memory reorderings.
//
// Conversions (cvt) are in software below, each with what PTX documents and what is not
// verified on hardware. No floating-point operation of the kernels changes: the host
// build uses SSE arithmetic with -ffp-contract=off (no FMA, like --fmad=false),
// correctly rounded division and sqrtf (like NVRTC's defaults), subnormals kept (no
// FTZ, like NVRTC without --ftz), and C99 fmaxf (NaN-dropping, like CUDA's).
#pragma once

#ifndef ARF_HOST
#error "arfuse_host.h is the host build's header (-DARF_HOST=1)"
#endif

// System headers come first: the CUDA keywords below are macros that would clash with
// attributes spelled inside libstdc++ (e.g. __noinline__). Only light C headers are
// used: <atomic> and <cmath> were about two thirds of each variant's compile time, so
// atomics are GCC's __atomic builtins (what std::atomic / std::atomic_ref compile to,
// same memory orders), bit casts __builtin_bit_cast, and the three math functions
// the kernels call are declared below exactly as <math.h> declares them (GCC treats
// them as the same builtins: sqrtss, correctly rounded).
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <sched.h>
#include <unistd.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define ARF_HOST_ASAN 1
#endif
#if !defined(__x86_64__) || defined(ARF_HOST_UCONTEXT)
#include <ucontext.h>
#define ARF_HOST_USE_UCONTEXT 1
#endif
extern "C" {
float sqrtf(float) noexcept;
float fmaxf(float, float) noexcept;
float fabsf(float) noexcept;
}

// ---------------------------------------------------------------- CUDA keywords
#define __device__
#define __global__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(n)
// One instance per OS thread = per CTA (see the execution model above).
#define __shared__ static thread_local

// ---------------------------------------------------------------- CUDA vector types
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct dim3 {
  unsigned int x, y, z;
};
inline uint4 make_uint4(unsigned int a, unsigned int b, unsigned int c, unsigned int d) { return uint4{a, b, c, d}; }
inline uint2 make_uint2(unsigned int a, unsigned int b) { return uint2{a, b}; }
inline float __uint_as_float(unsigned int u) { return __builtin_bit_cast(float, u); }
inline unsigned int __float_as_uint(float f) { return __builtin_bit_cast(unsigned int, f); }

// The launch configuration of one CTA, passed by the Rust launcher. Mirrored by
// `HostCta` in crates/runtime/src/host.rs (repr(C)); both sides check the size.
struct ArfHostCta {
  unsigned int grid[3];
  unsigned int block[3];
  unsigned int block_idx[3];
  unsigned int chaos;              // per mille: chance of a pause at each store or fence
  unsigned long long seed;          // fiber order per pass: 0 ascending, else seeded random
  // Fiber stacks, owned by the launcher (mapped once, with a guard page below each,
  // and reused): fiber i's stack is [stack_base + i * stack_stride, + stack_bytes).
  unsigned long long stack_base;
  unsigned long long stack_stride;
  unsigned long long stack_bytes;
};
static_assert(sizeof(ArfHostCta) == 72, "ArfHostCta layout changed: update HostCta in host/launch.rs");

// Status codes of arf_host_run_cta (the message says more).
#define ARF_HOST_OK 0
#define ARF_HOST_ERR_CONFIG 1      // bad launch configuration (block not whole warps, ...)
#define ARF_HOST_ERR_RESOURCE 2    // no (or too small) fiber stacks given
#define ARF_HOST_ERR_BARRIER 3     // divergent, incomplete or deadlocked __syncthreads
#define ARF_HOST_ERR_WARP 4        // shuffle with a partial mask / width, or lanes exited

namespace arf_host {

// ---------------------------------------------------------------- conversions
// PTX `cvt` in software. What PTX documents (PTX ISA, cvt and "Floating Point Notes"):
// .rn is round to nearest, ties to even; without .ftz subnormal inputs and results are
// kept; without .satfinite an f16 / bf16 overflow gives infinity; with .satfinite a
// finite value or infinity beyond the destination's range gives the sign-preserved
// largest finite value (MAX_NORM) and a NaN gives the destination's NaN; NaN results of
// f16 / bf16 conversions are the canonical NaN 0x7FFF. e4m3 ("e4m3fn") has the NaN
// codes 0x7F / 0xFF; the canonical one is 0x7F. e2m1 has NO NaN: what the .satfinite
// e2m1x2 conversion returns for a NaN input is NOT verified on hardware; this file
// follows arfuse rounding contract v1 (crates/reference/src/numerics/fp4.rs): +6 (0x7).
// Also unverified on hardware and taken from the contract: the sign of a zero result
// of e4m3 / e2m1 is the input's (-0.0 and negative values rounding to 0 give 0x80 /
// 0x8), and the NaN payload of cvt.f32.f16 (the canonical f32 NaN 0x7FFFFFFF is
// returned; no kernel output can show the payload, every later conversion makes it
// canonical again). Every function here is checked exhaustively against arfuse-reference
// and `half` by crates/runtime/tests/host_numerics.rs.

inline uint32_t f32_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

// Magnitude code of |x| (bits `a`, sign cleared, not NaN) in a small float format with
// `mbits` mantissa bits whose smallest normal exponent is `emin` (unbiased), rounded to
// nearest even. The result may exceed the format's largest code (callers saturate or
// overflow to infinity). f32 subnormal inputs are below half the smallest subnormal of
// every format used here (emin >= -14), so they give 0.
inline uint32_t small_float_code(uint32_t a, int emin, int mbits) {
  const uint32_t eb = a >> 23, mant = a & 0x7fffffu;
  if (eb == 0) return 0;
  const int e = (int)eb - 127;
  if (e >= emin) {
    const int drop = 23 - mbits;
    const uint32_t rest = mant & ((1u << drop) - 1u), half = 1u << (drop - 1);
    const uint64_t top = ((uint64_t)(e - emin + 1) << mbits) | (mant >> drop);
    const uint64_t code = top + ((rest > half || (rest == half && (top & 1u))) ? 1u : 0u);
    return code > 0xffffffffu ? 0xffffffffu : (uint32_t)code;
  }
  // Below the smallest normal: count quanta of 2^(emin - mbits). The significand
  // M = 1.mant * 2^23 is scaled by 2^(e - 23 - emin + mbits) = 2^-s, s >= 24 - mbits.
  const uint32_t m = mant | 0x800000u;
  const int s = 23 + emin - mbits - e;
  if (s > 24) return 0;  // M / 2^s < 2^24 / 2^25 = 1/2
  const uint32_t q = m >> s, rest = m & ((1u << s) - 1u), half = 1u << (s - 1);
  return q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u);
}

// cvt.rn.bf16.f32: round to nearest even, overflow to infinity, subnormals kept, NaN ->
// 0x7FFF. bf16 has f32's exponent range, so rounding the low 16 bits is exact for every
// non-NaN input (a carry moves into the exponent, the largest finite values into inf).
inline uint16_t cvt_rn_bf16_f32(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// cvt.rn.f16.f32: round to nearest even, overflow (|x| >= 65520) to infinity, f16
// subnormals kept, NaN -> 0x7FFF.
inline uint16_t cvt_rn_f16_f32(float f) {
  const uint32_t u = f32_bits(f), a = u & 0x7fffffffu;
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  if (a > 0x7f800000u) return 0x7fffu;
  const uint32_t code = small_float_code(a, -14, 10);
  return (uint16_t)(sign | (code >= 0x7c00u ? 0x7c00u : code));
}

// cvt.f32.f16: exact (every f16 is an f32); NaN -> 0x7FFFFFFF (see above).
inline float cvt_f32_f16(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return __builtin_bit_cast(float, m == 0 ? (sign | 0x7f800000u) : 0x7fffffffu);
  if (e == 0) {
    // m * 2^-24: exact (m < 2^10, the product is a normal f32 or zero).
    const float mag = (float)m * 5.9604644775390625e-8f;
    return __builtin_bit_cast(float, sign | f32_bits(mag));
  }
  return __builtin_bit_cast(float, sign | ((e + 112u) << 23) | (m << 13));
}

// One value of cvt.rn.satfinite.e4m3x2.f32: round to nearest even, saturate to +-448
// (infinity too), NaN -> 0x7F, the sign of zero kept.
inline uint32_t cvt_rn_satfinite_e4m3_f32(float f) {
  const uint32_t u = f32_bits(f), a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fu;
  const uint32_t code = small_float_code(a, -6, 3);
  return ((u >> 24) & 0x80u) | (code > 0x7eu ? 0x7eu : code);
}

// One value of cvt.rn.satfinite.e2m1x2.f32: round to nearest even, saturate to +-6
// (infinity too), the sign of zero kept, NaN -> 0x7 (contract v1; unverified, see above).
inline uint32_t cvt_rn_satfinite_e2m1_f32(float f) {
  const uint32_t u = f32_bits(f), a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7u;
  const uint32_t code = small_float_code(a, 0, 1);
  return ((u >> 28) & 0x8u) | (code > 0x7u ? 0x7u : code);
}

// ---------------------------------------------------------------- memory operations
// 32-bit atomic accesses of device addresses (addr is 4-byte aligned).
inline uint32_t* word(uint64_t addr) { return reinterpret_cast<uint32_t*>(addr); }
inline uint32_t load_relaxed(uint64_t addr) { return __atomic_load_n(word(addr), __ATOMIC_RELAXED); }
inline uint32_t load_acquire(uint64_t addr) { return __atomic_load_n(word(addr), __ATOMIC_ACQUIRE); }
inline void store_relaxed(uint64_t addr, uint32_t v) { __atomic_store_n(word(addr), v, __ATOMIC_RELAXED); }
inline void store_release(uint64_t addr, uint32_t v) { __atomic_store_n(word(addr), v, __ATOMIC_RELEASE); }
// fence.acq_rel.sys
inline void fence_acq_rel() { __atomic_thread_fence(__ATOMIC_ACQ_REL); }
inline void chaos_point();
// ld.volatile.global.v4.u32 / ld.relaxed.sys: four relaxed 32-bit loads.
inline uint4 ld_relaxed_v4(uint64_t addr) {
  return uint4{load_relaxed(addr), load_relaxed(addr + 4), load_relaxed(addr + 8), load_relaxed(addr + 12)};
}
inline void chaos_point();
inline uint64_t chaos_draw();
// st.relaxed.sys.global.v4.u32: four relaxed 32-bit stores. PTX gives a v4 store no
// single-copy atomicity across its words, so with chaos on the store tears: its words
// go out in a random order, with a chance of a pause (chaos_point) between any two, so
// that a peer's poll can see any subset of them written (a reader that tests only one
// word of a vector for readiness then reads the others unwritten).
inline void st_relaxed_v4(uint64_t addr, uint4 v) {
  chaos_point();
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint64_t r = chaos_draw();
  if (r == 0) {
    for (int i = 0; i < 4; ++i) store_relaxed(addr + 4u * (uint64_t)i, w[i]);
    return;
  }
  int order[4] = {0, 1, 2, 3};
  for (int i = 3; i > 0; --i) {
    const int j = (int)(r % (uint64_t)(i + 1));
    r /= (uint64_t)(i + 1);
    const int t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (int i = 0; i < 4; ++i) {
    if (i > 0) chaos_point();
    store_relaxed(addr + 4u * (uint64_t)order[i], w[order[i]]);
  }
}
// %globaltimer: nanoseconds of a monotonic clock.
inline uint64_t globaltimer() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// ---------------------------------------------------------------- the CTA executor
// Scheduling: passes over the block's fibers in an order (ascending, or a seeded
// permutation drawn anew each pass). A fiber that must give up the CPU (it blocks at a
// barrier, polls, or returns) switches DIRECTLY to the next runnable fiber of the pass
// (no hop through a scheduler context); at the end of a pass the end-of-pass step runs
// on whichever fiber gets there: it detects a deadlock (no fiber runnable), backs off
// when the pass made no progress (only polls) and draws the next order. The OS
// thread's own context is used only to start the first fiber and to return when the
// block finished or failed.
enum class FiberState { Runnable, AtBarrier, AtWarp, Done };

struct Fiber {
  dim3 tid;
  FiberState state;
  void* sp;            // saved stack pointer (hand-written switch)
  char* stack_lo;      // lowest byte of the usable stack
  size_t stack_size;
#if defined(ARF_HOST_USE_UCONTEXT)
  ucontext_t ctx;
#endif
#if defined(ARF_HOST_ASAN)
  void* fake_stack;
#endif
};

struct Warp {
  uint32_t slot[2][32];  // shuffle values, double-buffered by generation parity
  uint32_t gen;          // completed warp barriers
  uint32_t arrived;
};

struct Cta {
  void (*body)(const void*);
  const void* arg;
  dim3 grid, block, block_idx;
  Fiber* fibers;
  uint32_t* order;   // this pass's order of fiber indices
  uint32_t n;        // threads of the block
  uint32_t cur;      // running fiber
  uint32_t pos;      // position of the running fiber in `order`
  uint32_t done;     // fibers that returned
  uint64_t rng;      // 0: ascending order every pass
  uint64_t chaos_rng;
  uint32_t chaos;    // per-mille chance of a pause at a chaos point
  unsigned idle;     // consecutive passes without progress
  bool progress;     // something other than a poll happened in this pass
  bool ran;          // some fiber ran in this pass
  // Block barrier: arrivals of the current generation and the call site they used.
  uint32_t bar_arrived;
  const char* bar_file;
  int bar_line;
  Warp* warps;
  int status;
  char msg[256];
  // The OS thread's context.
  void* main_sp;
#if defined(ARF_HOST_USE_UCONTEXT)
  ucontext_t main_ctx;
#endif
#if defined(ARF_HOST_ASAN)
  const void* main_stack_lo;
  size_t main_stack_size;
  void* main_fake_stack;
#endif
};

inline thread_local Cta* t_cta = nullptr;

inline Fiber& current() { return t_cta->fibers[t_cta->cur]; }

// Records the first error of the CTA (later ones are consequences).
inline void fail(int status, const char* fmt, int a = 0, int b = 0, int c = 0) {
  Cta* k = t_cta;
  if (k->status != ARF_HOST_OK) return;
  k->status = status;
  snprintf(k->msg, sizeof k->msg, fmt, a, b, c);
}

#if !defined(ARF_HOST_USE_UCONTEXT)
// Saves the callee-saved registers of the System V x86-64 ABI and the stack pointer in
// *save, switches to the stack `next` and restores its registers. MXCSR and the x87
// control word (also callee-saved) are never changed by the kernels, so every fiber
// shares the OS thread's.
extern "C" __attribute__((naked, noinline, visibility("hidden"))) inline void arf_host_switch(void**, void*) {
  asm volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
#endif

// Saves the running context in (save_sp / save_ctx), resumes (to_sp / to_ctx) on the
// stack [to_lo, to_lo + to_size). `exiting`: the running fiber never resumes.
// Returns when something switches back to the saved context.
inline void switch_context(void** save_sp, void* to_sp, [[maybe_unused]] void* save_ctx,
                           [[maybe_unused]] void* to_ctx, [[maybe_unused]] void** fake_save,
                           [[maybe_unused]] const void* to_lo, [[maybe_unused]] size_t to_size,
                           [[maybe_unused]] bool exiting) {
#if defined(ARF_HOST_ASAN)
  __sanitizer_start_switch_fiber(exiting ? nullptr : fake_save, to_lo, to_size);
#endif
#if defined(ARF_HOST_USE_UCONTEXT)
  (void)save_sp;
  (void)to_sp;
  swapcontext(static_cast<ucontext_t*>(save_ctx), static_cast<ucontext_t*>(to_ctx));
#else
  arf_host_switch(save_sp, to_sp);
#endif
#if defined(ARF_HOST_ASAN)
  __sanitizer_finish_switch_fiber(*fake_save, nullptr, nullptr);
#endif
  // The compiler must not keep shared-memory values in registers across a switch.
  asm volatile("" ::: "memory");
}

inline void* fiber_ctx([[maybe_unused]] Fiber& f) {
#if defined(ARF_HOST_USE_UCONTEXT)
  return &f.ctx;
#else
  return nullptr;
#endif
}
inline void** fiber_fake([[maybe_unused]] Fiber& f) {
#if defined(ARF_HOST_ASAN)
  return &f.fake_stack;
#else
  return nullptr;
#endif
}

// From the running fiber back to the OS thread's context (the block finished or failed).
inline void to_main(bool exiting) {
  Cta* k = t_cta;
  Fiber& f = current();
#if defined(ARF_HOST_ASAN)
  const void* lo = k->main_stack_lo;
  const size_t size = k->main_stack_size;
#else
  const void* lo = nullptr;
  const size_t size = 0;
#endif
#if defined(ARF_HOST_USE_UCONTEXT)
  void* main_ctx = &k->main_ctx;
#else
  void* main_ctx = nullptr;
#endif
  switch_context(&f.sp, k->main_sp, fiber_ctx(f), main_ctx, fiber_fake(f), lo, size, exiting);
}

// xorshift64* step, for the per-pass fiber order.
inline uint64_t next_random(uint64_t& s) {
  s ^= s >> 12;
  s ^= s << 25;
  s ^= s >> 27;
  return s * 0x2545f4914f6cdd1dull;
}

// A chaos point (every global store and fence of the kernels): with probability
// chaos / 1000 the whole CTA (its OS thread) pauses for 0..2 ms, as a CTA can be
// descheduled at any instruction on a GPU. Opens the windows between two accesses of
// one thread that other CTAs and ranks could otherwise never observe.
inline void chaos_point() {
  Cta* k = t_cta;
  if (k == nullptr || k->chaos == 0) return;
  const uint64_t r = next_random(k->chaos_rng);
  if (r % 1000u >= k->chaos) return;
  timespec ts{0, (long)((r >> 32) % 2000u) * 1000L};
  nanosleep(&ts, nullptr);
}

// A random number for a torn store's word order, or 0 when chaos is off.
inline uint64_t chaos_draw() {
  Cta* k = t_cta;
  if (k == nullptr || k->chaos == 0) return 0;
  return next_random(k->chaos_rng) | 1u;
}

// After a pass without progress: yield the OS thread, then sleep, at most 200 us.
inline void idle_backoff(unsigned idle_passes) {
  if (idle_passes < 4) {
    sched_yield();
    return;
  }
  const unsigned us = idle_passes - 4 < 8 ? (1u << (idle_passes - 4)) : 200u;
  timespec ts{0, (long)(us < 200u ? us : 200u) * 1000L};
  nanosleep(&ts, nullptr);
}

// The end-of-pass step: deadlock check, backoff, the next pass's order.
inline void end_of_pass(Cta* k) {
  if (!k->ran) {
    snprintf(k->msg, sizeof k->msg,
                  "deadlock: no thread can run (%u of %u returned, %u at __syncthreads line %d, the rest at a warp shuffle)",
                  k->done, k->n, k->bar_arrived, k->bar_line);
    k->status = ARF_HOST_ERR_BARRIER;
    return;
  }
  k->idle = k->progress ? 0 : k->idle + 1;
  if (k->idle > 0) idle_backoff(k->idle);
  if (k->rng != 0) {
    for (uint32_t i = k->n - 1; i > 0; --i) {
      const uint32_t j = (uint32_t)(next_random(k->rng) % (i + 1));
      const uint32_t t = k->order[i];
      k->order[i] = k->order[j];
      k->order[j] = t;
    }
  }
  k->progress = false;
  k->ran = false;
  k->pos = UINT32_MAX;  // the next advance starts at position 0
}

// The running fiber gives up the CPU (it blocked, polled or returned: `exiting`):
// switch to the next runnable fiber of the pass, running end-of-pass steps as needed.
// Returns when the running fiber is resumed (at once when it is the only one runnable).
inline void reschedule(bool exiting) {
  Cta* k = t_cta;
  const uint32_t me = k->cur;
  for (;;) {
    if (k->status != ARF_HOST_OK || k->done == k->n) {
      to_main(exiting);
      return;  // only reached if the OS thread resumed us (it never does)
    }
    while (++k->pos < k->n) {
      const uint32_t i = k->order[k->pos];
      Fiber& t = k->fibers[i];
      if (t.state != FiberState::Runnable) continue;
      k->ran = true;
      if (i == me) return;
      k->cur = i;
      Fiber& f = k->fibers[me];
      switch_context(&f.sp, t.sp, fiber_ctx(f), fiber_ctx(t), fiber_fake(f), t.stack_lo, t.stack_size, exiting);
      return;
    }
    end_of_pass(k);
  }
}

// First code of every fiber; never returns.
[[noreturn]] inline void fiber_main() {
  Cta* k = t_cta;
#if defined(ARF_HOST_ASAN)
  const void* old_lo = nullptr;
  size_t old_size = 0;
  __sanitizer_finish_switch_fiber(nullptr, &old_lo, &old_size);
  if (k->main_stack_lo == nullptr) {  // the first fiber is started from the OS thread
    k->main_stack_lo = old_lo;
    k->main_stack_size = old_size;
  }
#endif
  k->body(k->arg);
  current().state = FiberState::Done;
  k->done += 1;
  k->progress = true;
  reschedule(true);
  __builtin_unreachable();
}

// Prepares fiber f to start in fiber_main on its own stack.
inline void init_fiber(Fiber& f) {
#if defined(ARF_HOST_USE_UCONTEXT)
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack_lo;
  f.ctx.uc_stack.ss_size = f.stack_size;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, (void (*)())fiber_main, 0);
#else
  // Top of the stack, 16-byte aligned: [top-8] a zero return address (so fiber_main
  // starts with the stack alignment of a called function), [top-16] fiber_main (what
  // `ret` jumps to), then six zeroed callee-saved registers that the switch pops.
  uintptr_t top = ((uintptr_t)f.stack_lo + f.stack_size) & ~(uintptr_t)15;
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;
  *--sp = reinterpret_cast<void*>(&fiber_main);
  for (int r = 0; r < 6; ++r) *--sp = nullptr;
  f.sp = sp;
#endif
}

// __syncthreads at (file, line).
inline void syncthreads(const char* file, int line) {
  Cta* k = t_cta;
  if (k->done != 0) {
    fail(ARF_HOST_ERR_BARRIER, "__syncthreads at line %d after %d threads of the block exited", line, (int)k->done);
    reschedule(false);
    return;
  }
  if (k->bar_arrived == 0) {
    k->bar_file = file;
    k->bar_line = line;
  } else if (k->bar_file != file || k->bar_line != line) {
    fail(ARF_HOST_ERR_BARRIER, "divergent __syncthreads: thread %d at line %d, others at line %d",
         (int)current().tid.x, line, k->bar_line);
    reschedule(false);
    return;
  }
  k->progress = true;
  if (++k->bar_arrived == k->n) {
    k->bar_arrived = 0;
    for (uint32_t i = 0; i < k->n; ++i)
      if (k->fibers[i].state == FiberState::AtBarrier) k->fibers[i].state = FiberState::Runnable;
    return;  // the last thread to arrive goes on
  }
  current().state = FiberState::AtBarrier;
  reschedule(false);
}

// __shfl_xor_sync(mask, v, lane_mask, width) for 4-byte values.
inline uint32_t shfl_xor_bits(unsigned mask, uint32_t v, int lane_mask, int width) {
  Cta* k = t_cta;
  Fiber& f = current();
  if (mask != 0xffffffffu || width != 32 || lane_mask < 0 || lane_mask > 31) {
    fail(ARF_HOST_ERR_WARP, "__shfl_xor_sync with mask %#x, width %d, lane mask %d (only full warps)", (int)mask, width,
         lane_mask);
    reschedule(false);
    return v;
  }
  const uint32_t lane = f.tid.x & 31u, wi = f.tid.x >> 5;
  Warp& w = k->warps[wi];
  for (uint32_t l = 0; k->done != 0 && l < 32; ++l) {
    if (k->fibers[wi * 32 + l].state == FiberState::Done) {
      fail(ARF_HOST_ERR_WARP, "full-mask __shfl_xor_sync in warp %d while lane %d exited", (int)wi, (int)l);
      reschedule(false);
      return v;
    }
  }
  const uint32_t buf = w.gen & 1u;
  w.slot[buf][lane] = v;
  k->progress = true;
  if (++w.arrived == 32) {
    w.arrived = 0;
    w.gen += 1;
    for (uint32_t l = 0; l < 32; ++l) {
      Fiber& g = k->fibers[wi * 32 + l];
      if (g.state == FiberState::AtWarp) g.state = FiberState::Runnable;
    }
  } else {
    f.state = FiberState::AtWarp;
    reschedule(false);
  }
  return w.slot[buf][lane ^ (uint32_t)lane_mask];
}

// A spin-wait poll: give the other fibers (and, through the backoff, other CTAs) the CPU.
inline void spin_yield() { reschedule(false); }

// Runs one CTA of `body(arg)` on the calling OS thread. Returns an ARF_HOST_* code and,
// unless OK, a message in msg.
inline int run_cta(void (*body)(const void*), const void* arg, const ArfHostCta& cfg, char* msg, unsigned msg_len) {
  auto say = [&](const char* m) {
    if (msg_len > 0) snprintf(msg, msg_len, "%s", m);
  };
  const uint64_t n64 = (uint64_t)cfg.block[0] * cfg.block[1] * cfg.block[2];
  if (cfg.block[1] != 1 || cfg.block[2] != 1 || n64 == 0 || n64 > 1024 || n64 % 32 != 0) {
    say("block must be (32k, 1, 1) with 32 <= 32k <= 1024 threads");
    return ARF_HOST_ERR_CONFIG;
  }
  if (t_cta != nullptr) {
    say("this OS thread is already running a CTA");
    return ARF_HOST_ERR_CONFIG;
  }
  const uint32_t n = (uint32_t)n64;
  if (cfg.stack_base == 0 || cfg.stack_bytes < 16384 || cfg.stack_stride < cfg.stack_bytes) {
    say("fiber stacks: need a base and at least 16 KiB per fiber");
    return ARF_HOST_ERR_RESOURCE;
  }
  char* region = reinterpret_cast<char*>(cfg.stack_base);
  const size_t stride = (size_t)cfg.stack_stride, stack = (size_t)cfg.stack_bytes;
#if defined(ARF_HOST_ASAN)
  // The stacks held the fibers of an earlier CTA, whose frames' redzones are still
  // poisoned in the shadow memory.
  for (uint32_t i = 0; i < n; ++i) ASAN_UNPOISON_MEMORY_REGION(region + stride * i, stack);
#endif
  Cta k{};
  k.body = body;
  k.arg = arg;
  k.grid = dim3{cfg.grid[0], cfg.grid[1], cfg.grid[2]};
  k.block = dim3{cfg.block[0], 1, 1};
  k.block_idx = dim3{cfg.block_idx[0], cfg.block_idx[1], cfg.block_idx[2]};
  k.n = n;
  k.status = ARF_HOST_OK;
  k.rng = cfg.seed;
  k.chaos = cfg.chaos > 1000u ? 1000u : cfg.chaos;
  k.chaos_rng = cfg.seed ^ 0x9e3779b97f4a7c15ull;
  k.fibers = new Fiber[n]();
  k.warps = new Warp[n / 32]();
  k.order = new uint32_t[n];
  for (uint32_t i = 0; i < n; ++i) {
    Fiber& f = k.fibers[i];
    f.tid = dim3{i, 0, 0};
    f.state = FiberState::Runnable;
    f.stack_lo = region + stride * i;
    f.stack_size = stack;
    init_fiber(f);
    k.order[i] = i;
  }
  t_cta = &k;
  // The first pass: end_of_pass draws its order (a permutation when seeded); the
  // first advance then starts its first fiber from this OS thread's context.
  k.ran = true;
  k.progress = true;
  end_of_pass(&k);
  k.pos = 0;
  k.cur = k.order[0];
  k.ran = true;
  {
    Fiber& f = k.fibers[k.cur];
#if defined(ARF_HOST_USE_UCONTEXT)
    void* main_ctx = &k.main_ctx;
#else
    void* main_ctx = nullptr;
#endif
#if defined(ARF_HOST_ASAN)
    void** main_fake = &k.main_fake_stack;
#else
    void** main_fake = nullptr;
#endif
    switch_context(&k.main_sp, f.sp, main_ctx, fiber_ctx(f), main_fake, f.stack_lo, f.stack_size, false);
  }
  t_cta = nullptr;
  const int status = k.status;
  if (status != ARF_HOST_OK) say(k.msg);
  delete[] k.order;
  delete[] k.warps;
  delete[] k.fibers;
#if defined(ARF_HOST_ASAN)
  // Fibers left frames poisoned; the launcher reuses the stacks for other objects.
  for (uint32_t i = 0; i < n; ++i) ASAN_UNPOISON_MEMORY_REGION(region + stride * i, stack);
#endif
  return status;
}

}  // namespace arf_host

// ---------------------------------------------------------------- CUDA built-ins
#define threadIdx (::arf_host::current().tid)
#define blockIdx (::arf_host::t_cta->block_idx)
#define blockDim (::arf_host::t_cta->block)
#define gridDim (::arf_host::t_cta->grid)
#define __syncthreads() ::arf_host::syncthreads(__FILE__, __LINE__)

inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32) {
  return __builtin_bit_cast(float, ::arf_host::shfl_xor_bits(mask, __builtin_bit_cast(uint32_t, v), lane_mask, width));
}
inline unsigned int __shfl_xor_sync(unsigned mask, unsigned int v, int lane_mask, int width = 32) {
  return ::arf_host::shfl_xor_bits(mask, v, lane_mask, width);
}
inline int __shfl_xor_sync(unsigned mask, int v, int lane_mask, int width = 32) {
  return (int)::arf_host::shfl_xor_bits(mask, (uint32_t)v, lane_mask, width);
}
// CUDA atomics are relaxed (device scope).
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned int atomicOr(unsigned int* p, unsigned int v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// The C entry points of one compiled variant: the ABI check and the CTA runner for the
// kernel `fn` (written once per translation unit by the Rust compiler driver).
#define ARF_HOST_ENTRY(fn)                                                                             \
  static void arf_host_body(const void* p) { fn(*static_cast<const ArfParams*>(p)); }                  \
  extern "C" __attribute__((visibility("default"))) unsigned arf_host_abi(void) {                      \
    return (unsigned)(sizeof(ArfParams) * 1000u + sizeof(ArfHostCta));                                 \
  }                                                                                                    \
  extern "C" __attribute__((visibility("default"))) int arf_host_run_cta(                              \
      const ArfParams* p, const ArfHostCta* cta, char* msg, unsigned msg_len) {                        \
    return ::arf_host::run_cta(&arf_host_body, p, *cta, msg, msg_len);                                 \
  }
