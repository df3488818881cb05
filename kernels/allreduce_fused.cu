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
// Workspace of each rank: arfuse's one layout, defined in the policy crate
// (arfuse_policy::ArfuseLayout; offsets in ArfParams):
//   state     u32 words (arfuse_abi::protocol): ARF_STATE_CALL call counter n,
//             ARF_STATE_ARRIVALS CTA arrival count, ARF_STATE_USED + i bytes the last
//             call that used Lamport buffer i wrote into it, ARF_STATE_ABORT the abort
//             word a rank that gives up writes into every peer, ARF_STATE_HEADERS the
//             call headers (below)
//   lamport   3 buffers of lamport_stride bytes, filled with -0.0 at creation
// Both strategies run in the current buffer n % 3 and share the one call counter, so a
// graph may switch strategy (and T) between any two calls: there is no second counter
// to desynchronise and no inbox a late peer could still be reading.
#include "arfuse_common.cuh"

#ifndef ARF_W
#error "ARF_W must be defined"
#endif
#ifndef ARF_STRATEGY
#error "ARF_STRATEGY must be defined (1 one-shot, 2 two-shot)"
#endif
#if ARF_W < 1 || ARF_W > ARF_MAX_RANKS || ((ARF_WORLD_MASK >> ARF_W) & 1) == 0
#error "ARF_W must be one of the ABI's world sizes (arfuse_abi::WORLD_SIZES)"
#endif

// ---------------------------------------------------------------- the call protocol
// Call n uses Lamport buffer n % 3 of every rank and re-fills with the sentinel the
// buffer of call n - 1 ((n + 2) % 3), whose every written element this rank saw during
// call n - 1. Why n - 1 and not n - 2 ((n + 1) % 3): a peer that has finished call n
// may already be writing call n + 1 into buffer (n + 1) % 3 of this rank while this
// rank is still inside call n; a peer reaches call n + 2 only after this rank started
// call n + 1, i.e. after this kernel ended: no rank finishes a call before every rank
// has pushed its data for it (one-shot: every rank reads every rank's slot; two-shot:
// every owner reads every rank's scatter slot, and every rank reads the owners'
// gathered rows, so even the ranks that own no token when T < W wait for all).
//
// Fences. The clears of call n (buffer (n + 2) % 3) need no fence before the pushes of
// call n: those go to buffer n % 3, and a peer writes buffer (n + 2) % 3 of this rank
// again only in call n + 2, which it reaches only after reading this rank's push of
// call n + 1, issued by the NEXT kernel; a kernel's writes are performed in this GPU's
// L2 (the point of coherence of its memory, where a peer's stores land too) before the
// next kernel of the stream runs past arf_grid_dependency_wait, so the clears are in
// place before any push that lets a peer come back to the buffer. (The kernels used to
// issue a system fence on every thread before the pushes.) The same two boundaries
// order the call state (arf_call_end) before the next kernel reads it, so its writes
// need no fence either; the one device fence kept there orders each CTA's read of the
// call number before its arrival (a load followed by a relaxed atomic: without it a
// CTA's read could formally see the counter the last arrival advances).
//
// The arrival atomic stays (per-CTA call counters were the alternative): the grid
// width follows T (min(T, 256, what is co-resident)), so the CTAs of one call are not
// those of the next, and a counter per CTA would need every CTA of the widest grid
// launched on every call. One atomicAdd per CTA at the end of a call is off the data's
// path.
struct ArfCall {
  u64 ws;   // this rank's workspace
  u64 cur;  // byte offset of this call's Lamport buffer in every rank's workspace
};

// Byte offset of call `call`'s Lamport buffer in every rank's workspace, re-derived
// where it is used rather than held in registers across the call's phases.
__device__ __forceinline__ u64 arf_cur_off(const ArfParams& p, u32 call) {
  return p.off_lamport + (u64)(call % ARF_NBUF) * p.lamport_stride;
}

// Address of state word `word` of `rank`'s workspace.
__device__ __forceinline__ u64 arf_state_word(const ArfParams& p, int rank, u32 word) {
  return p.peer[rank] + p.off_state + (u64)word * 4u;
}

// The call header of call `call` of this launch (arfuse_abi::protocol::call_header).
__device__ __forceinline__ u32 arf_call_header(const ArfParams& p, u32 call) {
  return (((call + 1u) & 0xffu) << ARF_HDR_SEQ_SHIFT) | (((u32)p.T & 0xffffu) << ARF_HDR_T_SHIFT) |
         (p.call_tag & 0xffu);
}

// Header slot of `q` for call `call` in `rank`'s state block: two per rank, by parity
// (no rank is ever more than one call ahead of another).
__device__ __forceinline__ u64 arf_header_slot(const ArfParams& p, int rank, u32 call, int q) {
  return arf_state_word(p, rank, ARF_STATE_HEADERS + (call & 1u) * ARF_MAX_RANKS + (u32)q);
}

// Tells every peer that this rank gave up the call with `code` (its abort word), so that
// the peers stop polling at once instead of waiting for their own timeouts (on real
// ranks every process has its own error word). Once per CTA that gave up, from
// arf_call_end: not inlined into the poll loops, where it cost registers.
__device__ __forceinline__ void arf_abort_call(const ArfParams& p, int rank, u32 code) {
  for (int q = 0; q < ARF_W; ++q) arf_st_release_sys(arf_state_word(p, q, ARF_STATE_ABORT), code | ((u32)(rank + 1) << ARF_ABORT_RANK_SHIFT));
}

// Poll bookkeeping: every 1024 polls read the clock; give up (return true) after
// timeout_ns (setting the error word), or at once when this rank's error word or abort
// word says that a CTA of this rank or a peer already gave up.
struct ArfPoll {
  u64 t0;
  u32 spins;
};
// This rank's abort word, written by thread 0 at the call's begin: the polls read its
// address from shared memory in their rare path rather than deriving it there.
__shared__ u64 s_arf_abort_word;
__device__ __forceinline__ bool arf_poll_expired(ArfPoll& st, const ArfParams& p, u32 code) {
#if defined(ARF_HOST)
  arf_host::spin_yield();  // every poll of a spin-wait lets the other threads run
#endif
  if ((++st.spins & 1023u) != 0u) return false;
  const u64 now = arf_globaltimer();
  if (st.t0 == 0) st.t0 = now;
  if (arf_ld_volatile_u32(p.err) != 0u) return true;
  // Read through a volatile access so that the address is not hoisted into registers
  // held across the poll loops.
  if (arf_ld_volatile_u32(*reinterpret_cast<volatile u64*>(&s_arf_abort_word)) != 0u) {
    atomicOr(reinterpret_cast<u32*>(p.err), ARF_ERR_PEER_ABORT);
    return true;
  }
  if (now - st.t0 > p.timeout_ns) {
    atomicOr(reinterpret_cast<u32*>(p.err), code);
    return true;
  }
  return false;
}

// Reads the call number and the previous buffer's used bytes (thread 0, into shared
// memory), then re-fills this rank's share of the previous call's buffer. CTA 0's
// thread 0 writes this rank's call header into every peer.
__device__ __forceinline__ ArfCall arf_call_begin(const ArfParams& p, int rank, u32& s_call) {
  __shared__ u32 s_prev_used;
  const u64 ws = p.peer[rank];
  if (threadIdx.x == 0) {
    const u32 n = arf_ld_volatile_u32(arf_state_word(p, rank, ARF_STATE_CALL));
    s_call = n;
    s_arf_abort_word = arf_state_word(p, rank, ARF_STATE_ABORT);
    s_prev_used = arf_ld_volatile_u32(arf_state_word(p, rank, ARF_STATE_USED + (n + ARF_NBUF - 1u) % ARF_NBUF));
    if (blockIdx.x == 0) {
      const u32 h = arf_call_header(p, n);
      for (int q = 0; q < ARF_W; ++q) arf_st_release_sys(arf_header_slot(p, q, n, rank), h);
    }
  }
  __syncthreads();
  const u64 base = ws + p.off_lamport + (u64)((s_call + ARF_NBUF - 1u) % ARF_NBUF) * p.lamport_stride;
  const u64 nv = (u64)s_prev_used / (u64)ARF_VECTOR_BYTES;
  const uint4 sent = make_uint4(ARF_SENTINEL_WORD, ARF_SENTINEL_WORD, ARF_SENTINEL_WORD, ARF_SENTINEL_WORD);
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < nv; i += (u64)gridDim.x * blockDim.x)
    arf_st(base + i * (u64)ARF_VECTOR_BYTES, sent);
  ArfCall c;
  c.ws = ws;
  c.cur = p.off_lamport + (u64)(s_call % ARF_NBUF) * p.lamport_stride;
  return c;
}

// CTA 0's thread 0, after its pushes: waits for the W call headers of this call in this
// rank's state block and compares them with its own. A rank that runs another T,
// another call tag or another call of the sequence stops every rank with
// ARF_ERR_CALL_MISMATCH; without the check, such ranks would sum slots of different
// calls (a rank that skipped a call) or of different layouts (another T).
__device__ __forceinline__ void arf_check_headers(const ArfParams& p, int rank, u32 call, ArfPoll& poll,
                                                  volatile int* bail, u32 code) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const u32 mine = arf_call_header(p, call);
  for (int q = 0; q < ARF_W && !*bail; ++q) {
    const u64 slot = arf_header_slot(p, rank, call, q);
    u32 h = arf_ld_acquire_sys(slot);
    while ((h >> ARF_HDR_SEQ_SHIFT) != (mine >> ARF_HDR_SEQ_SHIFT) && !*bail) {
      if (arf_poll_expired(poll, p, code)) {
        *bail = 1;
        break;
      }
      h = arf_ld_acquire_sys(slot);
    }
    if (!*bail && h != mine) {
      atomicOr(reinterpret_cast<u32*>(p.err), ARF_ERR_CALL_MISMATCH);
      *bail = 1;
    }
  }
}

// The last CTA of this rank to arrive advances the call counter and records the bytes
// this call wrote into its buffer (what call n + 1 clears). A CTA that gave up on its
// own (a timeout, a header mismatch: error bits other than a peer's abort) first tells
// every peer.
__device__ __forceinline__ void arf_call_end(const ArfParams& p, int rank, u32 call, u64 used, volatile int* bail) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (*bail) {
      const u32 own = arf_ld_volatile_u32(p.err) & ~ARF_ERR_PEER_ABORT;
      if (own != 0u) arf_abort_call(p, rank, own);
    }
    u32* st = reinterpret_cast<u32*>(p.peer[rank] + p.off_state);
    __threadfence();  // this CTA's read of the call number before its arrival
    const u32 arrived = atomicAdd(st + ARF_STATE_ARRIVALS, 1u);
    if (arrived == gridDim.x - 1u) {
      // Read by the next kernel only (no fence: see "Fences").
      st[ARF_STATE_ARRIVALS] = 0u;
      st[ARF_STATE_USED + (call + ARF_NBUF - 1u) % ARF_NBUF] = 0u;
      st[ARF_STATE_USED + call % ARF_NBUF] = (u32)used;
      st[ARF_STATE_CALL] = call + 1u;
    }
  }
}

// Polls one 16-byte vector until no element holds the sentinel; on timeout (or when
// another rank already gave up) sets *bail and returns what it last read.
__device__ __forceinline__ uint4 arf_poll_vec(const ArfParams& p, u64 addr, ArfPoll& poll, volatile int* bail,
                                              u32 code) {
  uint4 d = arf_ld_sys(addr);
  while (!arf_vec_ready(d) && !*bail) {
    if (arf_poll_expired(poll, p, code)) {
      *bail = 1;
      break;
    }
    d = arf_ld_sys(addr);
  }
  return d;
}

// Slots loaded at once before any is waited for: the W peers' data arrive in any order,
// so issuing the loads together overlaps their round trips (a loop that polls slot 0
// to readiness before it even loads slot 1 pays W round trips in a row; with pairs, W/2).
// Two slots are 8 registers; 4 made ptxas spill (4-128 bytes) in 18 one-shot W = 8
// per-token-group FP8 and two-shot f32 FP8 variants at the 64-register budget of
// 1024-thread blocks (NVRTC 12.9, sm_90a), so W > 2 polls in pairs.
#define ARF_POLL_BATCH 2
static_assert(ARF_W % ARF_POLL_BATCH == 0, "the world size is a multiple of the poll batch");

// Sum of the W slots of one vector, polled, in rank order from +0.0 (contract clause
// 1), rounded to T. Slot s of the vector is at base + s * slot_bytes. Each batch of
// ARF_POLL_BATCH slots is loaded first, then every slot not yet written is polled again
// on its own; the sum still takes the slots in rank order.
__device__ __forceinline__ uint4 arf_reduce_slots(const ArfParams& p, u64 base, u64 slot_bytes, ArfPoll& poll,
                                                  volatile int* bail, u32 code) {
  float acc[ARF_VEC];
#pragma unroll
  for (int i = 0; i < ARF_VEC; ++i) acc[i] = 0.0f;
#pragma unroll 1
  for (int s0 = 0; s0 < ARF_W; s0 += ARF_POLL_BATCH) {
    uint4 d[ARF_POLL_BATCH];
#pragma unroll
    for (int j = 0; j < ARF_POLL_BATCH; ++j) d[j] = arf_ld_sys(base + (u64)(s0 + j) * slot_bytes);
#pragma unroll
    for (int j = 0; j < ARF_POLL_BATCH; ++j) {
      while (!arf_vec_ready(d[j]) && !*bail) {
        if (arf_poll_expired(poll, p, code)) {
          *bail = 1;
          break;
        }
        d[j] = arf_ld_sys(base + (u64)(s0 + j) * slot_bytes);
      }
      float f[ARF_VEC];
      arf_unpack(d[j], f);
#pragma unroll
      for (int i = 0; i < ARF_VEC; ++i) acc[i] += f[i];
    }
  }
  return arf_pack(acc);
}

// Prefetches into L2 the residual and weight vectors the epilogue of token t reads,
// before the token's polling (see arf_prefetch_l2).
__device__ __forceinline__ void arf_prefetch_epilogue(const ArfParams& p, int rank, int t, int vpt, int nvec) {
#if ARF_RESIDUAL
  const u64 res = arf_rank_ptr(p.residual_in, rank) + (u64)t * (u64)p.H * ARF_EB;
#endif
#pragma unroll
  for (int v = 0; v < ARF_MAX_VPT; ++v) {
    const int idx = arf_vec_idx(v);
    if (v < vpt && idx < nvec) {
#if ARF_RESIDUAL
      arf_prefetch_l2(res + (u64)idx * (u64)ARF_VECTOR_BYTES);
#endif
#if ARF_NORM
      arf_prefetch_l2(p.gamma + (u64)idx * (p.gamma_f32 ? ARF_VEC * 4u : (u32)ARF_VECTOR_BYTES));
#endif
    }
  }
}

// Asks L2 for every slot of every vector of one token before the first poll: a
// prefetch holds no register, so the W * vpt 16-byte reads of the token's reduce are
// in flight together (32 at W = 8, vpt = 4), where the register-held batch
// (ARF_POLL_BATCH) keeps two. The polls that follow then wait on L2, not on HBM, for
// every slot already written. A slot still holding the sentinel is re-read by its poll
// (a hint changes no value: peers' stores reach this GPU's L2, which the polls read).
__device__ __forceinline__ void arf_prefetch_slots(u64 base, u64 slot_bytes, int vpt, int nvec) {
#pragma unroll
  for (int v = 0; v < ARF_MAX_VPT; ++v) {
    const int idx = arf_vec_idx(v);
    if (v < vpt && idx < nvec) {
      // Not unrolled: one address register walks the slots (unrolled, W = 16 f32
      // two-shot with per-token FP8 spilled 4 bytes on sm_90a).
      u64 a = base + (u64)idx * (u64)ARF_VECTOR_BYTES;
#pragma unroll 1
      for (int s = 0; s < ARF_W; ++s, a += slot_bytes) arf_prefetch_l2(a);
    }
  }
}

#if ARF_STRATEGY == ARF_ONE_SHOT
// ---------------------------------------------------------------- one-shot Lamport
// Every rank writes its T tokens into slot `rank` of the current buffer of every peer
// (slot s: bytes [s * T * H * e, (s + 1) * T * H * e)), polls its own buffer until no
// element holds the sentinel, reduces in rank order and runs the epilogue.
// Bytes used per buffer: W * T * H * e.
__device__ __forceinline__ void arf_oneshot(const ArfParams& p, int rank, int vpt, int nvec, float* red) {
  const u64 row_bytes = (u64)p.H * ARF_EB;
  const u64 slot_bytes = (u64)p.T * row_bytes;
  __shared__ u32 s_call;
  __shared__ volatile int s_bail;
  if (threadIdx.x == 0) s_bail = 0;
  const ArfCall c = arf_call_begin(p, rank, s_call);

  // 1. Push this rank's tokens (-0.0 written as +0.0: -0.0 is the sentinel). No
  // fence before the pushes (see "Fences" above).
  const u64 x = arf_rank_ptr(p.x, rank);
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      if (v < vpt && idx < nvec) {
        const uint4 d = arf_vec_scrub(arf_ld(x + (u64)t * row_bytes + (u64)idx * (u64)ARF_VECTOR_BYTES));
        const u64 off = c.cur + (u64)rank * slot_bytes + (u64)t * row_bytes + (u64)idx * (u64)ARF_VECTOR_BYTES;
#pragma unroll
        for (int q = 0; q < ARF_W; ++q) arf_st_sys(p.peer[q] + off, d);
      }
    }
  }

  // 2. Poll, reduce in fixed rank order, epilogue. The buffer offset is re-derived from
  // s_call per token rather than held in registers across the epilogue (see arf_tid).
  ArfPoll poll = {0, 0};
  arf_check_headers(p, rank, s_call, poll, &s_bail, ARF_ERR_ONESHOT_TIMEOUT);
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
    arf_prefetch_epilogue(p, rank, t, vpt, nvec);
    const u64 tok = c.ws + p.off_lamport + (u64)(s_call % ARF_NBUF) * p.lamport_stride + (u64)t * row_bytes;
    arf_prefetch_slots(tok, slot_bytes, vpt, nvec);
    uint4 a[ARF_MAX_VPT];
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      a[v] = (v < vpt && idx < nvec)
                 ? arf_reduce_slots(p, tok + (u64)idx * (u64)ARF_VECTOR_BYTES, slot_bytes, poll, &s_bail, ARF_ERR_ONESHOT_TIMEOUT)
                 : make_uint4(0, 0, 0, 0);
    }
    arf_epilogue(p, rank, t, a, vpt, nvec, red);
  }
  arf_call_end(p, rank, s_call, (u64)ARF_W * slot_bytes, &s_bail);
}
#endif

#if ARF_STRATEGY == ARF_TWO_SHOT
// ---------------------------------------------------------------- two-shot Lamport
// Reduce-scatter then all-gather, both through the current Lamport buffer (no barrier):
//   scatter rows  [0, W * R) * row: slot s (rows s * R ..) holds rank s's rows of the
//                 tokens this rank owns, R = ceil(T / W)
//   gather rows   [W * R, W * R + T) * row: token t's all-reduced row, from its owner
// Bytes used per buffer: (W * R + T) * H * e <= 2 * ceil(T/W) * W * H * e, the policy's
// two-shot formula. Token ownership: the first T % W ranks own ceil(T/W) tokens, the
// rest floor(T/W) (zero when T < W: such a rank only pushes and polls the gather).
__device__ __forceinline__ int arf_owner_start(int o, int T) {
  const int base = T / ARF_W, rem = T % ARF_W;
  return o * base + (o < rem ? o : rem);
}
__device__ __forceinline__ int arf_owner_of(int t, int T) {
  const int base = T / ARF_W, rem = T % ARF_W;
  const int big = rem * (base + 1);
  return t < big ? t / (base + 1) : rem + (t - big) / base;
}

// The all-gather carries the sums rounded to T as they are: none is ever -0.0, the
// sentinel. The sum starts from +0.0, and IEEE addition gives -0.0 only for
// -0.0 + -0.0, so a zero sum is +0.0; every partial sum of T values is a multiple of
// T's smallest subnormal (2^-133 for bf16, 2^-24 for f16; f32 rounding of such a sum
// stays on that grid), so a nonzero sum rounds to a nonzero T value; and a NaN is not
// -0.0.
__device__ __forceinline__ void arf_twoshot(const ArfParams& p, int rank, int vpt, int nvec, float* red) {
  const u64 row_bytes = (u64)p.H * ARF_EB;
  const u64 rows = (u64)((p.T + ARF_W - 1) / ARF_W);
  __shared__ u32 s_call;
  __shared__ volatile int s_bail;
  if (threadIdx.x == 0) s_bail = 0;
  arf_call_begin(p, rank, s_call);
  const u64 x = arf_rank_ptr(p.x, rank);

  // 1. Reduce-scatter, push: token t goes to slot `rank` of its owner's buffer. No
  // fence before the pushes (see "Fences" above).
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
    const int o = arf_owner_of(t, p.T);
    const u64 dst = p.peer[o] + arf_cur_off(p, s_call) + ((u64)rank * rows + (u64)(t - arf_owner_start(o, p.T))) * row_bytes;
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      if (v < vpt && idx < nvec)
        arf_st_sys(dst + (u64)idx * (u64)ARF_VECTOR_BYTES, arf_vec_scrub(arf_ld(x + (u64)t * row_bytes + (u64)idx * (u64)ARF_VECTOR_BYTES)));
    }
  }

  // 2. Reduce the owned tokens (polled) in rank order, round, all-gather to every rank.
  ArfPoll poll = {0, 0};
  arf_check_headers(p, rank, s_call, poll, &s_bail, ARF_ERR_TWOSHOT_TIMEOUT);
  const int my_start = arf_owner_start(rank, p.T);
  const int my_end = arf_owner_start(rank + 1, p.T);
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
    if (t < my_start || t >= my_end) continue;
    const u64 src = p.peer[rank] + p.off_lamport + (u64)(s_call % ARF_NBUF) * p.lamport_stride + (u64)(t - my_start) * row_bytes;
    arf_prefetch_slots(src, rows * row_bytes, vpt, nvec);
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      if (v < vpt && idx < nvec) {
        const uint4 r =
            arf_reduce_slots(p, src + (u64)idx * (u64)ARF_VECTOR_BYTES, rows * row_bytes, poll, &s_bail, ARF_ERR_TWOSHOT_TIMEOUT);
        const u64 off = arf_cur_off(p, s_call) + ((u64)ARF_W * rows + (u64)t) * row_bytes + (u64)idx * (u64)ARF_VECTOR_BYTES;
#pragma unroll
        for (int q = 0; q < ARF_W; ++q) arf_st_sys(p.peer[q] + off, r);
      }
    }
  }

  // 3. Every rank polls the gathered rows of this CTA's tokens and runs the epilogue.
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
    arf_prefetch_epilogue(p, rank, t, vpt, nvec);
    const u64 row = p.peer[rank] + p.off_lamport + (u64)(s_call % ARF_NBUF) * p.lamport_stride +
                    ((u64)ARF_W * rows + (u64)t) * row_bytes;
    uint4 a[ARF_MAX_VPT];
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      a[v] = (v < vpt && idx < nvec)
                 ? arf_poll_vec(p, row + (u64)idx * (u64)ARF_VECTOR_BYTES, poll, &s_bail, ARF_ERR_TWOSHOT_TIMEOUT)
                 : make_uint4(0, 0, 0, 0);
    }
    arf_epilogue(p, rank, t, a, vpt, nvec, red);
  }
  arf_call_end(p, rank, s_call, ((u64)ARF_W * rows + (u64)p.T) * row_bytes, &s_bail);
}
#endif

extern "C" __global__ void __launch_bounds__(ARF_MAX_BLOCK_THREADS) arf_fused(const ArfParams p) {
  __shared__ float red[32];
  arf_grid_dependency_wait();
  const int rank = p.rank_base + (int)blockIdx.y;
  const int nvec = p.H * ARF_EB / ARF_VECTOR_BYTES;
  const int vpt = (nvec + (int)blockDim.x - 1) / (int)blockDim.x;
#if ARF_STRATEGY == ARF_ONE_SHOT
  arf_oneshot(p, rank, vpt, nvec, red);
#else
  arf_twoshot(p, rank, vpt, nvec, red);
#endif
  arf_zero_scale_padding(arf_rank_ptr(p.scale_out, rank), p.scale_row0, p.T, p.scale_rows, p.H);
  __syncthreads();
  arf_trigger_dependents();
}
