//! Every number arfuse's kernels are built for, and the rules that say whether a world
//! size or a row is one they run (domain.md §5-§6).

use crate::dtype::ActDtype;

/// World sizes W the fused kernels are compiled for (`ARF_W`): one variant per W. A
/// group of another size is planned unfused ([`world_unsupported`]).
pub const WORLD_SIZES: [u32; 4] = [2, 4, 8, 16];

/// Peers a kernel's parameters hold addresses for (`ARF_MAX_RANKS`, the length of
/// `ArfParams::peer`): the largest of [`WORLD_SIZES`].
pub const MAX_RANKS: u32 = 16;

/// Threads of a warp: the kernels' reductions shuffle within one.
pub const WARP_THREADS: u64 = 32;

/// Bytes of one vector of the kernels' loads and stores: a row must be a multiple of
/// it (`ARF_VECTOR_BYTES`; domain.md §6).
pub const VECTOR_BYTES: u64 = 16;

/// 16-byte vectors one thread keeps in registers between the two RMSNorm passes
/// (`ARF_MAX_VPT`). Every variant is checked for zero spills at this cap
/// (`crates/runtime/tests/kernels_compile.rs`).
pub const MAX_VECTORS_PER_THREAD: u64 = 4;

/// Most threads per block (`__launch_bounds__(ARF_MAX_BLOCK_THREADS)`).
pub const MAX_BLOCK_THREADS: u64 = 1024;

/// Fewest threads per block: four full warps, so no block reduction runs on a partial
/// warp (sub-warp blocks hung public kernels; domain.md §6).
pub const MIN_BLOCK_THREADS: u64 = 128;

/// Most bytes per token row the kernels run: [`MAX_BLOCK_THREADS`] x
/// [`MAX_VECTORS_PER_THREAD`] x [`VECTOR_BYTES`] = 65,536 (H = 32,768 at bf16, 16,384
/// at f32).
pub const MAX_ROW_BYTES: u64 = MAX_BLOCK_THREADS * MAX_VECTORS_PER_THREAD * VECTOR_BYTES;

/// Fewest bytes per token row: one warp of 16-byte vectors (H < 256 at 16 bits gave
/// sub-warp blocks that hung; domain.md §6).
pub const MIN_ROW_BYTES: u64 = WARP_THREADS * VECTOR_BYTES;

/// Elements per group of the fused per-token-group FP8 epilogue (`ARF_FP8_GROUP`):
/// DeepSeek-style block quant, group 128 (domain.md §1), the one group size the
/// kernels are built for.
pub const FP8_GROUP_SIZE: u64 = 128;

/// Elements per NVFP4 scale-factor block (`ARF_NVFP4_BLOCK`; domain.md §1).
pub const NVFP4_BLOCK: u64 = 16;

/// Rows of one swizzled NVFP4 scale tile (`ARF_NVFP4_TILE_ROWS`).
pub const NVFP4_TILE_ROWS: u64 = 128;

/// Scale columns of one swizzled NVFP4 scale tile (`ARF_NVFP4_TILE_COLS`).
pub const NVFP4_TILE_COLS: u64 = 4;

/// Lamport buffers that rotate, so no barrier is needed (`ARF_LAMPORT_BUFFERS`;
/// domain.md §5, §6): call n writes buffer n % 3 and clears the buffer of call n - 1.
pub const LAMPORT_BUFFER_COUNT: u64 = 3;

/// Bytes of the state block at the start of a workspace (per rank, `ARF_STATE_BYTES`).
/// The kernels keep 2 + [`LAMPORT_BUFFER_COUNT`] u32 words there (call counter, CTA
/// arrivals, bytes each Lamport buffer's last call wrote); 256 bytes leaves room and
/// keeps the buffers after it on 128-byte lines.
pub const STATE_BYTES: u64 = 256;

/// A Lamport buffer is a multiple of this many bytes: one 128-byte cache line, a
/// multiple of [`VECTOR_BYTES`], so every buffer starts line-aligned.
pub const BUFFER_ALIGN_BYTES: u64 = 128;

/// Why the fused kernels cannot run a group of `w` ranks, or `None` when they can
/// (W in [`WORLD_SIZES`]).
pub fn world_unsupported(w: u32) -> Option<String> {
    (!WORLD_SIZES.contains(&w)).then(|| {
        let sizes: Vec<String> = WORLD_SIZES.iter().map(u32::to_string).collect();
        format!(
            "world size {w}: arfuse's fused kernels are built for W in {{{}}} (their \
             parameters hold {MAX_RANKS} peers)",
            sizes.join(", ")
        )
    })
}

/// Bytes of one token row, `hidden * e`; `None` when it overflows u64.
pub const fn row_bytes(hidden: u64, dtype: ActDtype) -> Option<u64> {
    hidden.checked_mul(dtype.element_bytes())
}

/// Why the kernels cannot run rows of `hidden` elements of `dtype`, or `None` when they
/// can: rows above [`MAX_ROW_BYTES`], not a multiple of [`VECTOR_BYTES`], or under
/// [`MIN_ROW_BYTES`].
pub fn row_unsupported(hidden: u64, dtype: ActDtype) -> Option<String> {
    let Some(row) = row_bytes(hidden, dtype) else {
        return Some(format!(
            "H = {hidden} at {dtype}: H * element bytes overflows u64"
        ));
    };
    if row > MAX_ROW_BYTES {
        return Some(format!(
            "H = {hidden} at {dtype} is a row of {row} bytes; arfuse's kernels hold at most \
             {MAX_VECTORS_PER_THREAD} vectors of {VECTOR_BYTES} bytes per thread in \
             blocks of {MAX_BLOCK_THREADS} threads ({MAX_ROW_BYTES} bytes)"
        ));
    }
    row_shape_unsupported(hidden, dtype)
}

/// The shape half of [`row_unsupported`], which every kernel of 16-byte vectors and
/// warp-shuffle reductions shares (FlashInfer's too; domain.md §6): why rows of
/// `hidden` elements of `dtype` are not a multiple of [`VECTOR_BYTES`] or under
/// [`MIN_ROW_BYTES`], or `None`.
pub fn row_shape_unsupported(hidden: u64, dtype: ActDtype) -> Option<String> {
    let Some(row) = row_bytes(hidden, dtype) else {
        return Some(format!(
            "H = {hidden} at {dtype}: H * element bytes overflows u64"
        ));
    };
    if row % VECTOR_BYTES != 0 {
        return Some(format!(
            "H = {hidden} at {dtype} is a row of {row} bytes, not a multiple of the \
             kernels' {VECTOR_BYTES}-byte vectors"
        ));
    }
    if row < MIN_ROW_BYTES {
        return Some(format!(
            "H = {hidden} at {dtype} is a row of {row} bytes, under one warp of {VECTOR_BYTES}-byte \
             vectors ({MIN_ROW_BYTES} bytes); sub-warp blocks hung the warp-shuffle \
             reduction"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_agree_with_each_other() {
        assert_eq!(WORLD_SIZES.iter().max(), Some(&MAX_RANKS));
        assert_eq!(MAX_ROW_BYTES, 65_536);
        assert_eq!(MIN_ROW_BYTES, 512);
        assert_eq!(MIN_BLOCK_THREADS % WARP_THREADS, 0);
        assert_eq!(BUFFER_ALIGN_BYTES % VECTOR_BYTES, 0);
        assert_eq!(STATE_BYTES % BUFFER_ALIGN_BYTES, 0);
        // Call counter, CTA arrivals and one word per Lamport buffer fit the block.
        assert!((2 + LAMPORT_BUFFER_COUNT) * 4 <= STATE_BYTES);
        assert_eq!(FP8_GROUP_SIZE % NVFP4_BLOCK, 0);
    }

    #[test]
    fn world_sizes() {
        for w in [2, 4, 8, 16] {
            assert_eq!(world_unsupported(w), None);
        }
        for w in [0, 1, 3, 6, 12, 32, 64] {
            let why = world_unsupported(w).unwrap();
            assert!(why.contains(&format!("world size {w}:")), "{why}");
            assert!(why.contains("W in {2, 4, 8, 16}"), "{why}");
            assert!(why.contains("16 peers"), "{why}");
        }
    }

    #[test]
    fn rows() {
        assert_eq!(row_unsupported(256, ActDtype::Bf16), None);
        assert_eq!(row_unsupported(32_768, ActDtype::Bf16), None);
        assert_eq!(row_unsupported(16_384, ActDtype::F32), None);
        assert!(row_unsupported(32_776, ActDtype::Bf16)
            .unwrap()
            .contains("(65536 bytes)"));
        assert!(row_unsupported(260, ActDtype::Bf16)
            .unwrap()
            .contains("not a multiple"));
        assert!(row_unsupported(128, ActDtype::Bf16)
            .unwrap()
            .contains("under one warp"));
        assert!(row_unsupported(u64::MAX, ActDtype::F32)
            .unwrap()
            .contains("overflows"));
    }
}
