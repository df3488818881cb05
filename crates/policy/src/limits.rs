//! Size tables (domain.md §4) and the limits derived from them.
//!
//! All table values are stored in bytes (the sources give MiB; 0.5 MiB = 524,288).

use crate::bytes::{self, MIB};
use crate::error::{PolicyError, Result};
use crate::target::{ActDtype, KernelLibrary};
use arfuse_abi::{
    FP8_GROUP_SIZE, MAX_BLOCK_THREADS, MAX_VECTORS_PER_THREAD, MIN_BLOCK_THREADS, VECTOR_BYTES,
};

/// Max all-reduce input bytes per rank eligible for fusion, by (SM, W): vLLM's tuned
/// table (domain.md §4). A missing (SM, W) pair means "no fusion", with a reason.
pub const MAX_BYTES_TABLE: &[(u32, u32, u64)] = &[
    (90, 2, 64 * MIB),
    (90, 4, 2 * MIB),
    (90, 8, MIB / 2),
    (100, 2, 64 * MIB),
    (100, 4, 32 * MIB),
    (100, 8, MIB),
    (100, 16, 64 * MIB),
    (103, 2, 64 * MIB),
    (103, 4, 64 * MIB),
    (103, 8, 4 * MIB),
    (103, 16, 64 * MIB),
    (107, 2, 64 * MIB),
    (107, 4, 64 * MIB),
    (107, 8, 2 * MIB),
];

/// One-shot upper bound of per-rank input bytes for the trtllm backend, by (SM, W):
/// vLLM's table (domain.md §4). Missing entries make vLLM's selector choose one-shot.
pub const TRTLLM_ONE_SHOT_TABLE: &[(u32, u32, u64)] = &[
    (90, 2, 32 * MIB),
    (90, 4, 2 * MIB),
    (90, 8, MIB / 2),
    (100, 2, 32 * MIB),
    (100, 4, 4 * MIB),
    (100, 8, MIB),
    (103, 2, 32 * MIB),
    (103, 4, 4 * MIB),
    (103, 8, 2 * MIB),
    (107, 2, 32 * MIB),
    (107, 4, 4 * MIB),
    (107, 8, 2 * MIB),
];

/// The largest Lamport comm size `W*M*H*e` (bytes) of the trtllm backend: INT32_MAX
/// rounded down to 2 MiB. Above it one-shot is impossible (an overflow there caused
/// illegal memory accesses; domain.md §5).
pub const LAMPORT_MAX_COMM_BYTES: u64 = 2_145_386_496;

/// Most bytes per token row FlashInfer's fused kernels support: H = 65,536 at bf16
/// (domain.md §6). A wider row is an error at plan time (no fused kernel runs it and no
/// model has it; H = 2^40 lands here). arfuse's own kernels stop earlier, at
/// [`arfuse_abi::MAX_ROW_BYTES`] (a reason to stay unfused, not an error).
pub const FLASHINFER_MAX_ROW_BYTES: u64 = 65_536 * 2;

/// Why the fused kernels cannot quantise per-token groups of `group_size` elements, or
/// `None` when they can (only [`FP8_GROUP_SIZE`]).
pub fn group_quant_unsupported_reason(group_size: u64) -> Option<String> {
    (group_size != FP8_GROUP_SIZE).then(|| {
        format!(
            "the fused kernels quantise groups of {FP8_GROUP_SIZE} elements, not \
             {group_size}"
        )
    })
}

/// Threads per block arfuse's kernels launch for a token of `hidden` elements: the
/// fewest vectors per thread (at most [`arfuse_abi::MAX_VECTORS_PER_THREAD`]) within
/// [`arfuse_abi::MAX_BLOCK_THREADS`], rounded up to whole warps, at least
/// [`arfuse_abi::MIN_BLOCK_THREADS`]. H = 4096 bf16 -> 512; H = 32,768 bf16 -> 1024.
///
/// Errors: [`PolicyError::InvalidHidden`] with [`row_unsupported_reason`]'s sentence
/// when arfuse's kernels cannot run the row.
pub fn arfuse_block_threads(hidden: u64, dtype: ActDtype) -> Result<u32> {
    check_hidden(hidden, dtype)?;
    if let Some(reason) = row_unsupported_reason(KernelLibrary::Arfuse, hidden, dtype)? {
        return Err(PolicyError::InvalidHidden { hidden, reason });
    }
    let vectors = row_bytes(hidden, dtype)? / VECTOR_BYTES;
    let per_thread = vectors.div_ceil(MAX_BLOCK_THREADS);
    debug_assert!(per_thread <= MAX_VECTORS_PER_THREAD);
    let warp = arfuse_abi::WARP_THREADS;
    let threads = vectors.div_ceil(per_thread).div_ceil(warp) * warp;
    // At most MAX_BLOCK_THREADS by construction (per_thread >= vectors / MAX_BLOCK_THREADS).
    Ok(threads.max(MIN_BLOCK_THREADS) as u32)
}

fn lookup(table: &[(u32, u32, u64)], sm: u32, w: u32) -> Option<u64> {
    table
        .iter()
        .find(|&&(s, ww, _)| s == sm && ww == w)
        .map(|&(_, _, b)| b)
}

/// The max-bytes table entry (bytes per rank) for (SM, W), or `None` when the table
/// has none (domain.md §4).
pub fn max_bytes_entry(sm: u32, w: u32) -> Option<u64> {
    lookup(MAX_BYTES_TABLE, sm, w)
}

/// The trtllm one-shot bound (bytes per rank) for (SM, W), or `None` when the table has
/// none (domain.md §4).
pub fn trtllm_one_shot_bound(sm: u32, w: u32) -> Option<u64> {
    lookup(TRTLLM_ONE_SHOT_TABLE, sm, w)
}

/// Bytes of one token row, `H * e`.
///
/// Errors: [`PolicyError::Overflow`].
pub fn row_bytes(hidden: u64, dtype: ActDtype) -> Result<u64> {
    bytes::mul(hidden, dtype.element_bytes(), "row bytes H*e")
}

/// Checks that a hidden size can be planned at all.
///
/// Errors: [`PolicyError::InvalidHidden`] for H = 0 or a row above
/// [`FLASHINFER_MAX_ROW_BYTES`], the widest any fused kernel library runs (no model has
/// it; H = 2^40 lands here). Small or misaligned rows are not errors: see [`row_unsupported_reason`].
pub fn check_hidden(hidden: u64, dtype: ActDtype) -> Result<()> {
    if hidden == 0 {
        return Err(PolicyError::InvalidHidden {
            hidden,
            reason: "hidden size must be >= 1 element".to_string(),
        });
    }
    let row = row_bytes(hidden, dtype).map_err(|_| PolicyError::InvalidHidden {
        hidden,
        reason: "H * element bytes overflows u64".to_string(),
    })?;
    if row > FLASHINFER_MAX_ROW_BYTES {
        return Err(PolicyError::InvalidHidden {
            hidden,
            reason: format!(
                "a row of {row} bytes exceeds the widest fused kernels' (FlashInfer's) maximum \
                 of {FLASHINFER_MAX_ROW_BYTES} bytes (H = {} at {dtype}); check that H is in \
                 elements",
                FLASHINFER_MAX_ROW_BYTES / dtype.element_bytes()
            ),
        });
    }
    Ok(())
}

/// Why `kernels` cannot fuse a (valid) hidden size, or `None` when they can. arfuse's
/// kernels: the ABI's rule ([`arfuse_abi::row_unsupported`]: rows above
/// [`arfuse_abi::MAX_ROW_BYTES`], not a multiple of [`VECTOR_BYTES`], or under
/// [`arfuse_abi::MIN_ROW_BYTES`]). FlashInfer's: the same two shape rules, up to
/// [`FLASHINFER_MAX_ROW_BYTES`] (domain.md §6), which [`check_hidden`] enforces.
///
/// Errors: [`PolicyError::Overflow`].
pub fn row_unsupported_reason(
    kernels: KernelLibrary,
    hidden: u64,
    dtype: ActDtype,
) -> Result<Option<String>> {
    row_bytes(hidden, dtype)?;
    Ok(match kernels {
        KernelLibrary::Arfuse => arfuse_abi::row_unsupported(hidden, dtype),
        KernelLibrary::Flashinfer => arfuse_abi::row_shape_unsupported(hidden, dtype),
    })
}

/// `max_token_num = min(floor(max_bytes / (H * e)), max_batched_tokens)` in tokens
/// (domain.md §4). `hidden` is the widest hidden size sharing the workspace.
///
/// Errors: [`PolicyError::InvalidHidden`] for H = 0; [`PolicyError::Overflow`].
pub fn max_token_num(
    max_bytes: u64,
    hidden: u64,
    dtype: ActDtype,
    max_batched_tokens: u64,
) -> Result<u64> {
    check_hidden(hidden, dtype)?;
    let row = row_bytes(hidden, dtype)?;
    Ok(bytes::floor_div(max_bytes, row, "max_token_num")?.min(max_batched_tokens))
}

/// The largest M for which the trtllm Lamport comm size `W*M*H*e` stays within
/// [`LAMPORT_MAX_COMM_BYTES`] (tokens). Example: H = 4096, fp16, W = 2 -> 130,944
/// (domain.md §5).
///
/// Errors: [`PolicyError::InvalidHidden`] for H = 0, [`PolicyError::InvalidField`] for
/// W = 0, [`PolicyError::Overflow`].
pub fn trtllm_lamport_max_tokens(w: u32, hidden: u64, dtype: ActDtype) -> Result<u64> {
    if w == 0 {
        return Err(PolicyError::InvalidField {
            field: "world_size",
            value: "0".to_string(),
            reason: "the all-reduce group needs at least one rank".to_string(),
        });
    }
    check_hidden(hidden, dtype)?;
    let per_token = bytes::product(
        &[u64::from(w), hidden, dtype.element_bytes()],
        "Lamport bytes per token",
    )?;
    bytes::floor_div(LAMPORT_MAX_COMM_BYTES, per_token, "Lamport max tokens")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_hold_domain_values() {
        assert_eq!(max_bytes_entry(90, 8), Some(524_288));
        assert_eq!(max_bytes_entry(100, 8), Some(MIB));
        assert_eq!(max_bytes_entry(103, 16), Some(64 * MIB));
        assert_eq!(max_bytes_entry(90, 16), None);
        assert_eq!(max_bytes_entry(107, 16), None);
        assert_eq!(max_bytes_entry(120, 4), None);
        assert_eq!(trtllm_one_shot_bound(103, 8), Some(2 * MIB));
        assert_eq!(trtllm_one_shot_bound(100, 4), Some(4 * MIB));
        assert_eq!(trtllm_one_shot_bound(100, 16), None);
    }

    #[test]
    fn max_token_num_worked_examples() {
        // domain.md §4: H=8192 bf16 SM90 W=8 -> 32; DeepSeek H=7168 SM100 W=8 -> 73.
        let e = max_bytes_entry(90, 8).unwrap();
        assert_eq!(max_token_num(e, 8192, ActDtype::Bf16, 8192), Ok(32));
        let e = max_bytes_entry(100, 8).unwrap();
        assert_eq!(max_token_num(e, 7168, ActDtype::Bf16, 8192), Ok(73));
        // The seed: H=6144 bf16 SM90 W=8 -> 42; capped by max batched tokens.
        let e = max_bytes_entry(90, 8).unwrap();
        assert_eq!(max_token_num(e, 6144, ActDtype::Bf16, 8192), Ok(42));
        assert_eq!(max_token_num(e, 6144, ActDtype::Bf16, 16), Ok(16));
    }

    #[test]
    fn lamport_limit_h4096_fp16_w2() {
        assert_eq!(
            trtllm_lamport_max_tokens(2, 4096, ActDtype::F16),
            Ok(130_944)
        );
        assert_eq!(2 * 130_944 * 4096 * 2, LAMPORT_MAX_COMM_BYTES);
        assert!(trtllm_lamport_max_tokens(0, 4096, ActDtype::F16).is_err());
    }

    #[test]
    fn hidden_checks() {
        assert!(check_hidden(0, ActDtype::Bf16).is_err());
        assert!(matches!(
            check_hidden(1 << 40, ActDtype::Bf16),
            Err(PolicyError::InvalidHidden { hidden, .. }) if hidden == 1 << 40
        ));
        assert!(check_hidden(u64::MAX, ActDtype::F32).is_err());
        assert_eq!(check_hidden(65_536, ActDtype::Bf16), Ok(()));
        match check_hidden(65_536, ActDtype::F32) {
            Err(PolicyError::InvalidHidden { reason, .. }) => assert!(
                reason.contains("maximum of 131072 bytes (H = 32768 at f32)"),
                "{reason}"
            ),
            other => panic!("{other:?}"),
        }
        for k in [KernelLibrary::Arfuse, KernelLibrary::Flashinfer] {
            assert_eq!(row_unsupported_reason(k, 256, ActDtype::Bf16), Ok(None));
            assert!(row_unsupported_reason(k, 128, ActDtype::Bf16)
                .unwrap()
                .is_some());
            assert!(row_unsupported_reason(k, 260, ActDtype::Bf16)
                .unwrap()
                .is_some());
            assert_eq!(row_unsupported_reason(k, 128, ActDtype::F32), Ok(None));
        }
        // arfuse's kernels stop at 64 KiB rows, FlashInfer's at 128 KiB.
        let ar = |h, d| row_unsupported_reason(KernelLibrary::Arfuse, h, d).unwrap();
        let fi = |h, d| row_unsupported_reason(KernelLibrary::Flashinfer, h, d).unwrap();
        assert_eq!(ar(32_768, ActDtype::Bf16), None);
        assert!(ar(32_776, ActDtype::Bf16).unwrap().contains("65536 bytes"));
        assert_eq!(fi(65_536, ActDtype::Bf16), None);
        assert_eq!(ar(16_384, ActDtype::F32), None);
        assert!(ar(16_388, ActDtype::F32).is_some());
    }

    #[test]
    fn only_group_128_is_fused() {
        assert_eq!(group_quant_unsupported_reason(128), None);
        assert!(group_quant_unsupported_reason(64)
            .unwrap()
            .contains("groups of 128 elements, not 64"));
    }

    #[test]
    fn arfuse_block_threads_worked_examples() {
        // 16-byte vectors: H=4096 bf16 is 512 vectors -> 512 threads, one each.
        assert_eq!(arfuse_block_threads(4096, ActDtype::Bf16), Ok(512));
        // H=7168 bf16: 896 vectors -> 896 threads.
        assert_eq!(arfuse_block_threads(7168, ActDtype::Bf16), Ok(896));
        // H=16384 bf16: 2048 vectors -> 2 per thread, 1024 threads.
        assert_eq!(arfuse_block_threads(16_384, ActDtype::Bf16), Ok(1024));
        // H=2880 bf16 (gpt-oss): 360 vectors -> 360 rounded up to 384 threads.
        assert_eq!(arfuse_block_threads(2880, ActDtype::Bf16), Ok(384));
        // Small rows still get 128 threads; 32,768 bf16 is the last that fits.
        assert_eq!(arfuse_block_threads(256, ActDtype::Bf16), Ok(128));
        assert_eq!(arfuse_block_threads(32_768, ActDtype::Bf16), Ok(1024));
        assert!(arfuse_block_threads(32_776, ActDtype::Bf16).is_err());
        assert!(arfuse_block_threads(250, ActDtype::Bf16).is_err());
    }
}
