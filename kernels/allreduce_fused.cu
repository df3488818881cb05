// allreduce_fused.cu -- fused all-reduce -> (residual add) -> (RMSNorm) -> (quant).
//
// One entry point, `arf_fused`, whose strategy and epilogue are fixed by -D defines
// (see arfuse_common.cuh). Algorithms: ../../shared/domain.md section 6.
//
// Ranks: rank = p.rank_base + blockIdx.y. Virtual ranks launch grid (nblocks, W, 1)
// with rank_base 0 as ONE cooperative launch, so every CTA of every rank is resident
// at once; a real rank (one GPU per process) launches grid (nblocks, 1, 1) with
// rank_base = its rank. The kernel reaches every peer only through p.peer[], so
// both use this same code. Work split: CTA b handles tokens b, b + gridDim.x, ...;
// every rank uses the same grid, so CTA b of one rank only ever exchanges data with
// CTA b of the others.
//
// Workspace of each rank (offsets in ArfParams, computed by crates/runtime/src/layout.rs):
//   os_state  u32[16]: [0] one-shot call counter n, [1] CTA arrival count,
//             [2..5) bytes written into Lamport buffer i by the call that used it
//   ts_state  u32[256]: two-shot barrier epoch per CTA
//   ts_flags  u32[256][W]: two-shot barrier flags, [cta][source rank]
//   lamport   3 buffers of lamport_stride bytes, filled with -0.0 at creation
//   scatter   W slots x ceil(T/W) tokens x H x e (two-shot reduce-scatter inbox)
//   gather    T x H x e (two-shot all-gather inbox)
// One-shot and two-shot keep separate state (os_* vs ts_*): switching strategy
// between calls never desynchronises a shared counter.
#include "arfuse_common.cuh"

#ifndef ARF_W
#error "ARF_W must be defined"
#endif
#ifndef ARF_STRATEGY
#error "ARF_STRATEGY must be defined (1 one-shot, 2 two-shot)"
#endif
#if ARF_W != 2 && ARF_W != 4 && ARF_W != 8 && ARF_W != 16
#error "ARF_W must be 2, 4, 8 or 16"
#endif

#if ARF_STRATEGY == 1
// ---------------------------------------------------------------- one-shot Lamport
// Call n writes buffer n % 3 of every peer (slot = source rank), polls its own buffer
// n % 3 until no element holds the sentinel, reduces in rank order, and re-fills with
// the sentinel the buffer of call n - 1 ((n + 2) % 3), whose every element it saw
// written during call n - 1. Why n - 1 and not n - 2 ((n + 1) % 3): a peer that has
// finished call n may already be writing call n + 1 into buffer (n + 1) % 3 of this
// rank while this rank is still inside call n; a peer reaches call n + 2 only after
// this rank wrote its call n + 1 data, i.e. after this kernel ended.
__device__ __forceinline__ void arf_oneshot(const ArfParams& p, int rank, int vpt, int nvec, float* red) {
  const u64 row_bytes = (u64)p.H * ARF_EB;
  const u64 slot_bytes = (u64)p.T * row_bytes;
  const u64 ws = p.peer[rank];
  u32* os = reinterpret_cast<u32*>(ws + p.off_os_state);
  __shared__ u32 s_call, s_prev_used;
  __shared__ volatile int s_bail;
  if (threadIdx.x == 0) {
    const u32 n = arf_ld_volatile_u32(reinterpret_cast<u64>(os));
    s_call = n;
    s_prev_used = arf_ld_volatile_u32(reinterpret_cast<u64>(os + 2 + (n + 2u) % 3u));
    s_bail = 0;
  }
  __syncthreads();
  const u32 cur = s_call % 3u, prev = (s_call + 2u) % 3u;
  const u64 cur_off = p.off_lamport + (u64)cur * p.lamport_stride;

  // 1. Push this rank's tokens into slot `rank` of every peer's current buffer.
  const u64 x = arf_rank_ptr(p.x, rank);
  arf_fence_sys();  // order earlier writes (clears of previous calls) before the pushes
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      if (v < vpt && idx < nvec) {
        const uint4 d = arf_vec_scrub(arf_ld(x + (u64)t * row_bytes + (u64)idx * 16u));
        const u64 off = cur_off + (u64)rank * slot_bytes + (u64)t * row_bytes + (u64)idx * 16u;
#pragma unroll
        for (int q = 0; q < ARF_W; ++q) arf_st_sys(p.peer[q] + off, d);
      }
    }
  }

  // 2. Re-fill the previous call's buffer with the sentinel (this rank's share).
  {
    const u64 base = ws + p.off_lamport + (u64)prev * p.lamport_stride;
    const u64 nv = (u64)s_prev_used / 16u;
    const uint4 sent = make_uint4(ARF_SENTINEL_WORD, ARF_SENTINEL_WORD, ARF_SENTINEL_WORD, ARF_SENTINEL_WORD);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nv; i += (u64)gridDim.x * blockDim.x)
      arf_st(base + i * 16u, sent);
  }

  // 3. Poll, reduce in fixed rank order, epilogue. The buffer offset is re-derived
  // from s_call per token (and again in step 4) rather than held in registers across
  // the epilogue (see arf_tid).
  ArfPoll poll = {0, 0};
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
    const u64 tok_off = p.off_lamport + (u64)(s_call % 3u) * p.lamport_stride + (u64)t * row_bytes;
    uint4 a[ARF_MAX_VPT];
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      a[v] = make_uint4(0, 0, 0, 0);
      if (v < vpt && idx < nvec) {
        float acc[ARF_VEC];
#pragma unroll
        for (int i = 0; i < ARF_VEC; ++i) acc[i] = 0.0f;
        const u64 base = ws + tok_off + (u64)idx * 16u;
#pragma unroll 1
        for (int s = 0; s < ARF_W; ++s) {
          uint4 d = arf_ld_sys(base + (u64)s * slot_bytes);
          while (!arf_vec_ready(d) && !s_bail) {
            if (arf_poll_expired(poll, p, ARF_ERR_ONESHOT_TIMEOUT)) {
              s_bail = 1;
              break;
            }
            d = arf_ld_sys(base + (u64)s * slot_bytes);
          }
          float f[ARF_VEC];
          arf_unpack(d, f);
#pragma unroll
          for (int i = 0; i < ARF_VEC; ++i) acc[i] += f[i];
        }
        a[v] = arf_pack(acc);
      }
    }
    arf_epilogue(p, rank, t, a, vpt, nvec, red);
  }

  // 4. The last CTA of this rank advances the call counter and the bookkeeping.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const u32 arrived = atomicAdd(os + 1, 1u);
    if (arrived == gridDim.x - 1u) {
      const u32 n = s_call;  // this call; its buffer n % 3, previous (n + 2) % 3
      os[1] = 0u;
      os[2 + (n + 2u) % 3u] = 0u;
      os[2 + n % 3u] = (u32)((u64)ARF_W * slot_bytes);
      __threadfence();
      os[0] = n + 1u;
    }
  }
}
#endif

#if ARF_STRATEGY == 2
// ---------------------------------------------------------------- two-shot
// Token ownership: the first T % W ranks own ceil(T/W) tokens, the rest floor(T/W).
// Inbox reuse between calls is safe on virtual ranks (one launch holds every rank and
// launches are stream-ordered). With real ranks launching separately, a peer may start
// call k+1 while this rank's other CTAs still read call k's inboxes; when T (and so the
// row placement and the grid) differs between the two calls, CTA b' of the peer can
// overwrite rows CTA b != b' still reads. Real peers need a call-entry barrier (or
// double-buffered inboxes) before this kernel serves them.
__device__ __forceinline__ int arf_owner_start(int o, int T) {
  const int base = T / ARF_W, rem = T % ARF_W;
  return o * base + (o < rem ? o : rem);
}
__device__ __forceinline__ int arf_owner_of(int t, int T) {
  const int base = T / ARF_W, rem = T % ARF_W;
  const int big = rem * (base + 1);
  return t < big ? t / (base + 1) : rem + (t - big) / base;
}

// Cross-rank barrier of CTA blockIdx.x: signal epoch `e` to every peer (release,
// system scope), wait for every peer's signal (acquire). A peer can be at most one
// barrier ahead, hence the wrap-safe ">=" test.
__device__ __forceinline__ void arf_barrier(const ArfParams& p, int rank, u32 e, ArfPoll& poll, volatile int* bail) {
  __syncthreads();
  if (threadIdx.x < ARF_W) {
    const int q = threadIdx.x;
    arf_fence_sys();
    arf_st_release_sys(p.peer[q] + p.off_ts_flags + ((u64)blockIdx.x * ARF_W + rank) * 4u, e);
    const u64 mine = p.peer[rank] + p.off_ts_flags + ((u64)blockIdx.x * ARF_W + q) * 4u;
    while ((int)(arf_ld_acquire_sys(mine) - e) < 0) {
      if (arf_poll_expired(poll, p, ARF_ERR_TWOSHOT_TIMEOUT)) {
        *bail = 1;
        break;
      }
    }
    arf_fence_sys();
  }
  __syncthreads();
}

__device__ __forceinline__ void arf_twoshot(const ArfParams& p, int rank, int vpt, int nvec, float* red) {
  const u64 row_bytes = (u64)p.H * ARF_EB;
  const int rows_per_slot = (p.T + ARF_W - 1) / ARF_W;
  const u64 ws = p.peer[rank];
  u32* epoch_p = reinterpret_cast<u32*>(ws + p.off_ts_state) + blockIdx.x;
  __shared__ u32 s_epoch;
  __shared__ volatile int s_bail;
  if (threadIdx.x == 0) {
    s_epoch = *epoch_p;
    s_bail = 0;
  }
  __syncthreads();
  // Barrier epochs are s_epoch + 1 and s_epoch + 2, read from shared memory where
  // used instead of a register live across all three phases (see arf_tid).
  ArfPoll poll = {0, 0};
  const u64 x = arf_rank_ptr(p.x, rank);

  // 1. Reduce-scatter, push: token t goes to slot `rank` of its owner's inbox.
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
    const int o = arf_owner_of(t, p.T);
    const u64 dst = p.peer[o] + p.off_scatter +
                    ((u64)rank * rows_per_slot + (u64)(t - arf_owner_start(o, p.T))) * row_bytes;
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      if (v < vpt && idx < nvec) arf_st_sys(dst + (u64)idx * 16u, arf_ld(x + (u64)t * row_bytes + (u64)idx * 16u));
    }
  }
  arf_barrier(p, rank, s_epoch + 1u, poll, &s_bail);

  // 2. Reduce the owned tokens in rank order, round, all-gather to every rank.
  const int my_start = arf_owner_start(rank, p.T);
  const int my_end = arf_owner_start(rank + 1, p.T);
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
    if (t < my_start || t >= my_end) continue;
    const u64 src = ws + p.off_scatter + (u64)(t - my_start) * row_bytes;
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      if (v < vpt && idx < nvec) {
        float acc[ARF_VEC];
#pragma unroll
        for (int i = 0; i < ARF_VEC; ++i) acc[i] = 0.0f;
#pragma unroll 4
        for (int s = 0; s < ARF_W; ++s) {
          float f[ARF_VEC];
          arf_unpack(arf_ld_sys(src + (u64)s * rows_per_slot * row_bytes + (u64)idx * 16u), f);
#pragma unroll
          for (int i = 0; i < ARF_VEC; ++i) acc[i] += f[i];
        }
        const uint4 r = arf_pack(acc);
        const u64 off = p.off_gather + (u64)t * row_bytes + (u64)idx * 16u;
#pragma unroll
        for (int q = 0; q < ARF_W; ++q) arf_st_sys(p.peer[q] + off, r);
      }
    }
  }
  arf_barrier(p, rank, s_epoch + 2u, poll, &s_bail);

  // 3. Every rank runs the epilogue on every token of this CTA.
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
    uint4 a[ARF_MAX_VPT];
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      a[v] = (v < vpt && idx < nvec) ? arf_ld_sys(ws + p.off_gather + (u64)t * row_bytes + (u64)idx * 16u)
                                     : make_uint4(0, 0, 0, 0);
    }
    arf_epilogue(p, rank, t, a, vpt, nvec, red);
  }
  if (threadIdx.x == 0) *epoch_p = s_epoch + 2u;
}
#endif

extern "C" __global__ void __launch_bounds__(1024) arf_fused(const ArfParams p) {
  __shared__ float red[32];
  arf_grid_dependency_wait();
  const int rank = p.rank_base + (int)blockIdx.y;
  const int nvec = p.H * ARF_EB / 16;
  const int vpt = (nvec + (int)blockDim.x - 1) / (int)blockDim.x;
#if ARF_STRATEGY == 1
  arf_oneshot(p, rank, vpt, nvec, red);
#else
  arf_twoshot(p, rank, vpt, nvec, red);
#endif
  if (blockIdx.x == 0) arf_zero_scale_padding(arf_rank_ptr(p.scale_out, rank), p.T, p.H);
  __syncthreads();
  arf_trigger_dependents();
}
