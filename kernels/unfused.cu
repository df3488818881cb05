// unfused.cu -- the local (no communication) half of the unfused baseline, and the
// path for T above the fused range: (residual add) -> (RMSNorm) -> (quant) on a tensor
// that is already all-reduced. The all-reduce itself is `arf_fused` built with
// ARF_NORM=0, ARF_RESIDUAL=0, ARF_QUANT=0 (an all-reduce-only epilogue). A quant-only
// kernel is ARF_NORM=0, ARF_RESIDUAL=0 with a quant. Same rounding contract as the
// fused kernels (arfuse_common.cuh), so fused == unfused bit for bit, up to the
// block-reduction order of the RMSNorm sum of squares, which is the same code.
//
// Grid (nblocks, ranks, 1); rank = p.rank_base + blockIdx.y, so virtual ranks run in
// one launch. No cross-CTA dependencies: any grid size works.
#include "arfuse_common.cuh"

extern "C" __global__ void __launch_bounds__(ARF_MAX_BLOCK_THREADS) arf_local(const ArfParams p) {
  __shared__ float red[32];
  arf_grid_dependency_wait();
  const int rank = p.rank_base + (int)blockIdx.y;
  const int nvec = p.H * ARF_EB / ARF_VECTOR_BYTES;
  const int vpt = (nvec + (int)blockDim.x - 1) / (int)blockDim.x;
  const u64 row_bytes = (u64)p.H * ARF_EB;
  const u64 x = arf_rank_ptr(p.x, rank);
  for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
    uint4 a[ARF_MAX_VPT];
#pragma unroll
    for (int v = 0; v < ARF_MAX_VPT; ++v) {
      const int idx = arf_vec_idx(v);
      a[v] = (v < vpt && idx < nvec) ? arf_ld(x + (u64)t * row_bytes + (u64)idx * (u64)ARF_VECTOR_BYTES) : make_uint4(0, 0, 0, 0);
    }
    arf_epilogue(p, rank, t, a, vpt, nvec, red);
  }
  arf_zero_scale_padding(arf_rank_ptr(p.scale_out, rank), p.scale_row0, p.T, p.scale_rows, p.H);
  __syncthreads();
  arf_trigger_dependents();
}
