//! The `-D` defines every compilation of the kernel sources gets (NVRTC and the host
//! C++ compiler alike): the ABI's numbers under the names the sources use, so that the
//! sources hold none of them.

use crate::dtype::ActDtype;
use crate::limits::{
    BUFFER_ALIGN_BYTES, FP8_GROUP_SIZE, LAMPORT_BUFFER_COUNT, MAX_BLOCK_THREADS, MAX_RANKS,
    MAX_VECTORS_PER_THREAD, NVFP4_BLOCK, NVFP4_TILE_COLS, NVFP4_TILE_ROWS, STATE_BYTES,
    VECTOR_BYTES, WORLD_SIZES,
};
use crate::protocol;
use crate::quant::Quant;
use crate::strategy::Strategy;

/// One `-D<name>=<value>` define of a kernel compilation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelDefine {
    /// The macro name the kernel sources use (`ARF_MAX_RANKS`, `ARF_Q_FP8_TOKEN`, ...).
    pub name: &'static str,
    /// Its value (a non-negative integer).
    pub value: u64,
}

impl KernelDefine {
    /// The compiler option, `-D<name>=<value>`.
    pub fn option(&self) -> String {
        format!("-D{}={}", self.name, self.value)
    }
}

/// Every define the ABI hands to the kernel sources, the same for every variant (the
/// variant's own selection, `ARF_DTYPE`, `ARF_QUANT`, `ARF_W`, ..., comes on top):
///
/// | define | value |
/// |---|---|
/// | `ARF_MAX_RANKS` | [`MAX_RANKS`] |
/// | `ARF_WORLD_MASK` | bit W set for every W of [`WORLD_SIZES`] |
/// | `ARF_MAX_VPT` | [`MAX_VECTORS_PER_THREAD`] |
/// | `ARF_VECTOR_BYTES` | [`VECTOR_BYTES`] |
/// | `ARF_MAX_BLOCK_THREADS` | [`MAX_BLOCK_THREADS`] |
/// | `ARF_FP8_GROUP` | [`FP8_GROUP_SIZE`] |
/// | `ARF_NVFP4_BLOCK` | [`NVFP4_BLOCK`] |
/// | `ARF_NVFP4_TILE_ROWS`, `ARF_NVFP4_TILE_COLS` | [`NVFP4_TILE_ROWS`], [`NVFP4_TILE_COLS`] |
/// | `ARF_LAMPORT_BUFFERS` | [`LAMPORT_BUFFER_COUNT`] |
/// | `ARF_STATE_BYTES`, `ARF_BUFFER_ALIGN` | [`STATE_BYTES`], [`BUFFER_ALIGN_BYTES`] |
/// | `ARF_STATE_CALL` ... `ARF_STATE_HEADERS` | the state words of [`protocol`] |
/// | `ARF_ERR_*` | the error word bits of [`protocol`] |
/// | `ARF_HDR_SEQ_SHIFT`, `ARF_HDR_T_SHIFT` | [`protocol::call_header`]'s fields |
/// | `ARF_ABORT_RANK_SHIFT` | [`protocol::abort_word`]'s rank field |
/// | `ARF_DTYPE_BF16`, `ARF_DTYPE_F16`, `ARF_DTYPE_F32` | [`ActDtype::kernel_code`] |
/// | `ARF_Q_NONE` ... `ARF_Q_FP8_GROUP_F32_UE8M0` | [`Quant::kernel_code`] |
/// | `ARF_ONE_SHOT`, `ARF_TWO_SHOT` | [`Strategy::kernel_code`] |
pub fn kernel_defines() -> Vec<KernelDefine> {
    let d = |name, value| KernelDefine { name, value };
    let mut out = vec![
        d("ARF_MAX_RANKS", u64::from(MAX_RANKS)),
        d(
            "ARF_WORLD_MASK",
            WORLD_SIZES.iter().fold(0u64, |m, &w| m | (1u64 << w)),
        ),
        d("ARF_MAX_VPT", MAX_VECTORS_PER_THREAD),
        d("ARF_VECTOR_BYTES", VECTOR_BYTES),
        d("ARF_MAX_BLOCK_THREADS", MAX_BLOCK_THREADS),
        d("ARF_FP8_GROUP", FP8_GROUP_SIZE),
        d("ARF_NVFP4_BLOCK", NVFP4_BLOCK),
        d("ARF_NVFP4_TILE_ROWS", NVFP4_TILE_ROWS),
        d("ARF_NVFP4_TILE_COLS", NVFP4_TILE_COLS),
        d("ARF_LAMPORT_BUFFERS", LAMPORT_BUFFER_COUNT),
        d("ARF_STATE_BYTES", STATE_BYTES),
        d("ARF_BUFFER_ALIGN", BUFFER_ALIGN_BYTES),
        d("ARF_STATE_CALL", protocol::STATE_WORD_CALL),
        d("ARF_STATE_ARRIVALS", protocol::STATE_WORD_ARRIVALS),
        d("ARF_STATE_USED", protocol::STATE_WORD_USED),
        d("ARF_STATE_ABORT", protocol::STATE_WORD_ABORT),
        d("ARF_STATE_HEADERS", protocol::STATE_WORD_HEADERS),
        d(
            "ARF_ERR_ONESHOT_TIMEOUT",
            u64::from(protocol::ERR_ONESHOT_TIMEOUT),
        ),
        d(
            "ARF_ERR_TWOSHOT_TIMEOUT",
            u64::from(protocol::ERR_TWOSHOT_TIMEOUT),
        ),
        d(
            "ARF_ERR_CALL_MISMATCH",
            u64::from(protocol::ERR_CALL_MISMATCH),
        ),
        d("ARF_ERR_PEER_ABORT", u64::from(protocol::ERR_PEER_ABORT)),
        d("ARF_HDR_SEQ_SHIFT", u64::from(protocol::HEADER_SEQ_SHIFT)),
        d("ARF_HDR_T_SHIFT", u64::from(protocol::HEADER_TOKENS_SHIFT)),
        d(
            "ARF_ABORT_RANK_SHIFT",
            u64::from(protocol::ABORT_RANK_SHIFT),
        ),
    ];
    for t in ActDtype::ALL {
        out.push(d(t.define_name(), u64::from(t.kernel_code())));
    }
    for q in Quant::ALL {
        out.push(d(q.define_name(), u64::from(q.kernel_code())));
    }
    out.push(d("ARF_ONE_SHOT", u64::from(kernel_code(Strategy::OneShot))));
    out.push(d("ARF_TWO_SHOT", u64::from(kernel_code(Strategy::TwoShot))));
    out
}

fn kernel_code(s: Strategy) -> u32 {
    s.kernel_code().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_codes_distinct_per_kind() {
        let all = kernel_defines();
        let mut names: Vec<&str> = all.iter().map(|d| d.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len(), "duplicate define");
        let mut q: Vec<u32> = Quant::ALL.iter().map(|q| q.kernel_code()).collect();
        q.sort_unstable();
        assert_eq!(q, (0..8).collect::<Vec<_>>());
        let world = all.iter().find(|d| d.name == "ARF_WORLD_MASK").unwrap();
        assert_eq!(world.value, (1 << 2) | (1 << 4) | (1 << 8) | (1 << 16));
        assert_eq!(
            all.iter()
                .find(|d| d.name == "ARF_Q_FP8_GROUP_F32_UE8M0")
                .unwrap()
                .option(),
            "-DARF_Q_FP8_GROUP_F32_UE8M0=7"
        );
    }
}
