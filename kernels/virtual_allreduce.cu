// virtual_allreduce.cu -- the all-reduce of the unfused path on VIRTUAL ranks (every
// rank's tensor in the same device memory): out[r] = round_T(((+0.0 + x_0) + x_1) + ...
// + x_{W-1}) for every rank r, fp32 accumulation in rank order, contract clause 1.
// No workspace and no synchronisation between ranks: each rank reads every rank's
// input directly. It serves T above the fused range (and every T when no fused
// workspace could be created). On real ranks the collective library (NCCL) does this.
//
// Grid (nblocks, W, 1); rank = p.rank_base + blockIdx.y; any grid size works.
#include "arfuse_common.cuh"

#ifndef ARF_W
#error "ARF_W must be defined"
#endif

extern "C" __global__ void __launch_bounds__(ARF_MAX_BLOCK_THREADS) arf_virtual_allreduce(const ArfParams p) {
  arf_grid_dependency_wait();
  const int rank = p.rank_base + (int)blockIdx.y;
  const int nvec = p.H * ARF_EB / ARF_VECTOR_BYTES;
  const u64 row_bytes = (u64)p.H * ARF_EB;
  const u64 out = arf_rank_ptr(p.out, rank);
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
    for (int idx = threadIdx.x; idx < nvec; idx += blockDim.x) {
      float acc[ARF_VEC];
#pragma unroll
      for (int i = 0; i < ARF_VEC; ++i) acc[i] = 0.0f;
#pragma unroll 1
      for (int q = 0; q < ARF_W; ++q) {
        float f[ARF_VEC];
        arf_unpack(arf_ld(arf_rank_ptr(p.x, q) + (u64)t * row_bytes + (u64)idx * (u64)ARF_VECTOR_BYTES), f);
#pragma unroll
        for (int i = 0; i < ARF_VEC; ++i) acc[i] += f[i];
      }
      if (out) arf_st(out + (u64)t * row_bytes + (u64)idx * (u64)ARF_VECTOR_BYTES, arf_pack(acc));
    }
  }
  __syncthreads();
  arf_trigger_dependents();
}
