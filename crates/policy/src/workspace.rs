//! Workspace sizing (domain.md §5) and the bytes one call needs.
//!
//! One workspace serves one (all-reduce group, backend, dtype) and is sized for the
//! widest hidden size among every graph that shares it. Capacity is always checked
//! against ONE Lamport buffer (the workspace holds three that rotate), never against the
//! whole allocation: a caller that divided a 2 MiB allocation by bytes per token
//! believed 146 tokens fit where one buffer held 698,368 bytes.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::bytes;
use crate::error::{PolicyError, Result};
use crate::limits::{self, LAMPORT_MAX_COMM_BYTES};
use crate::strategy::Strategy;
use crate::target::ActDtype;

/// Lamport buffers rotate in threes, so no barrier is needed (domain.md §5, §6).
pub const LAMPORT_BUFFER_COUNT: u64 = 3;
/// Lamport buffer sizes are multiples of 32 bytes: stages must be 16-byte aligned and a
/// size of 16 mod 32 gave "misaligned address" (domain.md §5).
pub const LAMPORT_ALIGN_BYTES: u64 = 32;
/// The mnnvl allocation's signal pad, not part of any Lamport buffer (domain.md §5).
pub const MNNVL_SIGNAL_PAD_BYTES: u64 = 2048;
/// trtllm barrier flag words per rank (`W*256*4` bytes; domain.md §5).
pub const TRTLLM_BARRIER_FLAG_COUNT: u64 = 256;
/// Bytes per trtllm barrier flag word (an int; domain.md §5).
pub const TRTLLM_FLAG_BYTES: u64 = 4;
/// Two-shot stages a reduce-scatter and an all-gather half: `2*ceil(T/W)*W*H*e`
/// (domain.md §5).
pub const TWO_SHOT_STAGES: u64 = 2;

/// A fused all-reduce workspace, per rank. All sizes in bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workspace {
    /// The backend the workspace belongs to.
    pub backend: Backend,
    /// Activation dtype it was sized for.
    pub dtype: ActDtype,
    /// W, ranks in the group.
    pub world_size: u32,
    /// Hidden size (elements) it was sized for: the widest among the graphs sharing it.
    pub hidden: u64,
    /// M, the tokens it was sized for; `None` for a buffer given from outside.
    pub max_tokens: Option<u64>,
    /// Bytes of ONE Lamport buffer (of three). One-shot calls (both backends) and mnnvl
    /// two-shot calls must fit in it.
    pub lamport_buffer_bytes: u64,
    /// trtllm comm buffer used by two-shot (bytes); 0 for mnnvl.
    pub comm_buffer_bytes: u64,
    /// trtllm barrier flags (bytes); 0 for mnnvl.
    pub flag_bytes: u64,
    /// mnnvl signal pad (bytes); 0 for trtllm.
    pub signal_pad_bytes: u64,
    /// Everything allocated per rank (bytes), before any allocator granularity rounding.
    pub total_bytes_per_rank: u64,
}

fn check_args(w: u32, hidden: u64, dtype: ActDtype) -> Result<()> {
    if w == 0 {
        return Err(PolicyError::InvalidField {
            field: "world_size",
            value: "0".to_string(),
            reason: "the all-reduce group needs at least one rank".to_string(),
        });
    }
    limits::check_hidden(hidden, dtype)
}

fn check_tokens(t: u64, what: &str) -> Result<()> {
    if t == 0 {
        return Err(PolicyError::InvalidTokens {
            t,
            reason: format!("{what} must be >= 1 token"),
        });
    }
    Ok(())
}

/// Bytes of one token across the group, `H*W*e`.
fn group_row_bytes(hidden: u64, w: u32, dtype: ActDtype) -> Result<u64> {
    bytes::product(
        &[hidden, u64::from(w), dtype.element_bytes()],
        "bytes per token H*W*e",
    )
}

/// Bytes of ONE buffer a fused call of `t` tokens needs (domain.md §5):
/// one-shot `T*H*W*e` (both backends; the Lamport buffer); mnnvl two-shot
/// `2*ceil(T/W)*W*H*e` (the Lamport buffer); trtllm two-shot `W*T*H*e` (the comm
/// buffer; every rank's input staged); unfused 0.
///
/// Errors: [`PolicyError::InvalidTokens`] for T = 0; [`PolicyError::InvalidField`]
/// for W = 0; [`PolicyError::InvalidHidden`]; [`PolicyError::Overflow`].
pub fn required_bytes(
    backend: Backend,
    strategy: Strategy,
    t: u64,
    hidden: u64,
    w: u32,
    dtype: ActDtype,
) -> Result<u64> {
    check_tokens(t, "a call")?;
    check_args(w, hidden, dtype)?;
    let per_token = group_row_bytes(hidden, w, dtype)?;
    match (backend, strategy) {
        (_, Strategy::Unfused) => Ok(0),
        (_, Strategy::OneShot) | (Backend::Trtllm, Strategy::TwoShot) => {
            bytes::mul(t, per_token, "one-shot bytes T*H*W*e")
        }
        (Backend::Mnnvl, Strategy::TwoShot) => {
            let per_rank = bytes::ceil_div(t, u64::from(w), "ceil(T/W)")?;
            bytes::product(
                &[TWO_SHOT_STAGES, per_rank, per_token],
                "two-shot bytes 2*ceil(T/W)*W*H*e",
            )
        }
    }
}

impl Workspace {
    /// The default workspace of `backend` for M = `max_tokens` tokens (domain.md §5):
    /// see [`Workspace::mnnvl`] and [`Workspace::trtllm`].
    ///
    /// Errors: as those constructors.
    pub fn sized(
        backend: Backend,
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        max_tokens: u64,
    ) -> Result<Workspace> {
        match backend {
            Backend::Mnnvl => Workspace::mnnvl(w, hidden, dtype, max_tokens),
            Backend::Trtllm => Workspace::trtllm(w, hidden, dtype, max_tokens),
        }
    }

    /// FlashInfer's default mnnvl sizing for M tokens (domain.md §5):
    /// `B = max(min(floor(1 MiB / (W*e*H)), M) * H*W*e, 2*ceil(M/W)*W*H*e)` rounded up to
    /// 32 bytes; three buffers plus the 2,048-byte signal pad per rank.
    /// W=8, H=6144, bf16, M=42 -> B = 1,179,648.
    ///
    /// Errors: [`PolicyError::InvalidField`] (W = 0), [`PolicyError::InvalidHidden`],
    /// [`PolicyError::InvalidTokens`] (M = 0), [`PolicyError::Overflow`].
    pub fn mnnvl(w: u32, hidden: u64, dtype: ActDtype, max_tokens: u64) -> Result<Workspace> {
        check_args(w, hidden, dtype)?;
        check_tokens(max_tokens, "max_tokens")?;
        let per_token = group_row_bytes(hidden, w, dtype)?;
        let auto_tokens = bytes::floor_div(
            crate::strategy::MNNVL_AUTO_ONE_SHOT_BYTES,
            per_token,
            "mnnvl AUTO tokens",
        )?
        .min(max_tokens);
        let one_shot_part = bytes::mul(auto_tokens, per_token, "mnnvl one-shot part")?;
        let two_shot_part = required_bytes(
            Backend::Mnnvl,
            Strategy::TwoShot,
            max_tokens,
            hidden,
            w,
            dtype,
        )?;
        let buffer = bytes::round_up(
            one_shot_part.max(two_shot_part),
            LAMPORT_ALIGN_BYTES,
            "mnnvl buffer",
        )?;
        Self::mnnvl_with_buffer(w, hidden, dtype, Some(max_tokens), buffer)
    }

    /// An mnnvl workspace sized so one-shot fits every T up to M: `B = M*H*W*e`
    /// rounded up to 32 bytes (domain.md §5). Used by deterministic plans.
    ///
    /// Errors: as [`Workspace::mnnvl`].
    pub fn mnnvl_one_shot_everywhere(
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        max_tokens: u64,
    ) -> Result<Workspace> {
        check_args(w, hidden, dtype)?;
        check_tokens(max_tokens, "max_tokens")?;
        let need = required_bytes(
            Backend::Mnnvl,
            Strategy::OneShot,
            max_tokens,
            hidden,
            w,
            dtype,
        )?;
        let buffer = bytes::round_up(need, LAMPORT_ALIGN_BYTES, "mnnvl buffer")?;
        Self::mnnvl_with_buffer(w, hidden, dtype, Some(max_tokens), buffer)
    }

    /// An mnnvl workspace whose ONE Lamport buffer holds `buffer_bytes`, given from
    /// outside (for example by an engine that allocated it).
    ///
    /// Errors: [`PolicyError::InvalidField`] (`buffer_bytes`) when it is 0 or not a
    /// multiple of 32 (the rotating stages would be misaligned); others as
    /// [`Workspace::mnnvl`].
    pub fn mnnvl_from_buffer(
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        buffer_bytes: u64,
    ) -> Result<Workspace> {
        check_args(w, hidden, dtype)?;
        if buffer_bytes == 0 || buffer_bytes % LAMPORT_ALIGN_BYTES != 0 {
            return Err(PolicyError::InvalidField {
                field: "buffer_bytes",
                value: buffer_bytes.to_string(),
                reason: format!(
                    "one Lamport buffer must be a non-zero multiple of {LAMPORT_ALIGN_BYTES} \
                     bytes (a size of 16 mod 32 gave \"misaligned address\"; domain.md §5)"
                ),
            });
        }
        Self::mnnvl_with_buffer(w, hidden, dtype, None, buffer_bytes)
    }

    /// An mnnvl workspace from the size of its whole per-rank allocation: the
    /// allocation less the 2,048-byte signal pad, split in three, rounded down to 32
    /// bytes. A 2 MiB allocation gives ONE buffer of 698,368 bytes (domain.md §5).
    ///
    /// Errors: [`PolicyError::InvalidField`] (`allocation_bytes`) when no aligned
    /// buffer fits; others as [`Workspace::mnnvl`].
    pub fn mnnvl_from_allocation(
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        allocation_bytes: u64,
    ) -> Result<Workspace> {
        let usable = allocation_bytes.saturating_sub(MNNVL_SIGNAL_PAD_BYTES);
        let per_buffer = usable / LAMPORT_BUFFER_COUNT;
        let buffer = per_buffer - per_buffer % LAMPORT_ALIGN_BYTES;
        if buffer == 0 {
            return Err(PolicyError::InvalidField {
                field: "allocation_bytes",
                value: allocation_bytes.to_string(),
                reason: "too small for three aligned Lamport buffers and the signal pad"
                    .to_string(),
            });
        }
        let mut ws = Self::mnnvl_from_buffer(w, hidden, dtype, buffer)?;
        ws.total_bytes_per_rank = allocation_bytes;
        Ok(ws)
    }

    fn mnnvl_with_buffer(
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        max_tokens: Option<u64>,
        buffer: u64,
    ) -> Result<Workspace> {
        let total = bytes::add(
            bytes::mul(buffer, LAMPORT_BUFFER_COUNT, "mnnvl buffers")?,
            MNNVL_SIGNAL_PAD_BYTES,
            "mnnvl allocation",
        )?;
        Ok(Workspace {
            backend: Backend::Mnnvl,
            dtype,
            world_size: w,
            hidden,
            max_tokens,
            lamport_buffer_bytes: buffer,
            comm_buffer_bytes: 0,
            flag_bytes: 0,
            signal_pad_bytes: MNNVL_SIGNAL_PAD_BYTES,
            total_bytes_per_rank: total,
        })
    }

    /// The trtllm workspace for M tokens (domain.md §5): comm buffer `W*M*H*e`, barrier
    /// flags `W*256*4`, Lamport region of three buffers of `W*M*H*e` each. One Lamport
    /// buffer is clamped to [`LAMPORT_MAX_COMM_BYTES`]; above it one-shot cannot run, and
    /// the per-T checks then refuse one-shot beyond the limit
    /// (H=4096, fp16, W=2: one-shot up to T = 130,944 and no further).
    ///
    /// The sources write the comm buffer as `W*M*H*2` (sizeof(half)); arfuse uses `e`,
    /// which is the same for 16-bit types and not undersized for f32.
    ///
    /// Errors: as [`Workspace::mnnvl`].
    pub fn trtllm(w: u32, hidden: u64, dtype: ActDtype, max_tokens: u64) -> Result<Workspace> {
        check_args(w, hidden, dtype)?;
        check_tokens(max_tokens, "max_tokens")?;
        let comm_size = bytes::round_up(
            bytes::mul(
                max_tokens,
                group_row_bytes(hidden, w, dtype)?,
                "trtllm comm size",
            )?,
            LAMPORT_ALIGN_BYTES,
            "trtllm comm size",
        )?;
        let lamport = comm_size.min(LAMPORT_MAX_COMM_BYTES);
        let flags = bytes::product(
            &[u64::from(w), TRTLLM_BARRIER_FLAG_COUNT, TRTLLM_FLAG_BYTES],
            "trtllm flags",
        )?;
        let total = bytes::add(
            bytes::add(comm_size, flags, "trtllm workspace")?,
            bytes::mul(lamport, LAMPORT_BUFFER_COUNT, "trtllm Lamport region")?,
            "trtllm workspace",
        )?;
        Ok(Workspace {
            backend: Backend::Trtllm,
            dtype,
            world_size: w,
            hidden,
            max_tokens: Some(max_tokens),
            lamport_buffer_bytes: lamport,
            comm_buffer_bytes: comm_size,
            flag_bytes: flags,
            signal_pad_bytes: 0,
            total_bytes_per_rank: total,
        })
    }

    /// Bytes available to one call of `strategy` (bytes): one-shot -> one Lamport
    /// buffer; two-shot -> one Lamport buffer (mnnvl) or the comm buffer (trtllm);
    /// unfused -> 0 (it needs none).
    pub fn available_bytes(&self, strategy: Strategy) -> u64 {
        match (self.backend, strategy) {
            (_, Strategy::Unfused) => 0,
            (_, Strategy::OneShot) | (Backend::Mnnvl, Strategy::TwoShot) => {
                self.lamport_buffer_bytes
            }
            (Backend::Trtllm, Strategy::TwoShot) => self.comm_buffer_bytes,
        }
    }

    /// Bytes one call of `t` tokens at `hidden` needs under `strategy` in this
    /// workspace's backend, group and dtype (see [`required_bytes`]).
    ///
    /// Errors: as [`required_bytes`].
    pub fn required_bytes(&self, strategy: Strategy, t: u64, hidden: u64) -> Result<u64> {
        required_bytes(
            self.backend,
            strategy,
            t,
            hidden,
            self.world_size,
            self.dtype,
        )
    }

    /// Largest T (tokens) whose `strategy` call at `hidden` fits this workspace (0 when
    /// none). It ignores the two-shot T >= W rule and the size table. For
    /// [`Strategy::Unfused`], `u64::MAX`. Never "allocation / bytes per token".
    ///
    /// Errors: [`PolicyError::InvalidHidden`], [`PolicyError::Overflow`].
    pub fn capacity_tokens(&self, strategy: Strategy, hidden: u64) -> Result<u64> {
        check_args(self.world_size, hidden, self.dtype)?;
        let per_token = group_row_bytes(hidden, self.world_size, self.dtype)?;
        let avail = self.available_bytes(strategy);
        match (self.backend, strategy) {
            (_, Strategy::Unfused) => Ok(u64::MAX),
            (_, Strategy::OneShot) | (Backend::Trtllm, Strategy::TwoShot) => {
                bytes::floor_div(avail, per_token, "capacity tokens")
            }
            (Backend::Mnnvl, Strategy::TwoShot) => {
                // 2*ceil(T/W)*W*H*e <= B  <=>  ceil(T/W) <= floor(B / (2*W*H*e)).
                let per_rank = bytes::floor_div(
                    avail,
                    bytes::mul(TWO_SHOT_STAGES, per_token, "two-shot bytes per rank token")?,
                    "capacity tokens",
                )?;
                bytes::mul(per_rank, u64::from(self.world_size), "capacity tokens")
            }
        }
    }

    /// Problems of the workspace itself, as sentences (empty when sound): a Lamport
    /// buffer of 0 bytes or not a multiple of 32, a trtllm Lamport buffer above
    /// [`LAMPORT_MAX_COMM_BYTES`], W = 0 or an invalid hidden size.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Err(e) = check_args(self.world_size, self.hidden, self.dtype) {
            out.push(e.to_string());
        }
        if self.lamport_buffer_bytes == 0 {
            out.push("one Lamport buffer of 0 bytes holds no call".to_string());
        } else if self.lamport_buffer_bytes % LAMPORT_ALIGN_BYTES != 0 {
            out.push(format!(
                "one Lamport buffer of {} bytes is not a multiple of {LAMPORT_ALIGN_BYTES} \
                 (\"misaligned address\"; domain.md §5)",
                self.lamport_buffer_bytes
            ));
        }
        if self.backend == Backend::Trtllm && self.lamport_buffer_bytes > LAMPORT_MAX_COMM_BYTES {
            out.push(format!(
                "trtllm Lamport comm size {} bytes exceeds {LAMPORT_MAX_COMM_BYTES} \
                 (INT32_MAX rounded down to 2 MiB; domain.md §5)",
                self.lamport_buffer_bytes
            ));
        }
        out
    }
}

impl fmt::Display for Workspace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} workspace (W={}, H={}, {}",
            self.backend, self.world_size, self.hidden, self.dtype
        )?;
        if let Some(m) = self.max_tokens {
            write!(f, ", M={m}")?;
        }
        write!(
            f,
            "): one Lamport buffer {} bytes (of {LAMPORT_BUFFER_COUNT})",
            self.lamport_buffer_bytes
        )?;
        if self.backend == Backend::Trtllm {
            write!(
                f,
                ", comm buffer {} bytes, flags {} bytes",
                self.comm_buffer_bytes, self.flag_bytes
            )?;
        } else {
            write!(f, ", signal pad {} bytes", self.signal_pad_bytes)?;
        }
        write!(f, "; {} bytes per rank", self.total_bytes_per_rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::MIB;

    #[test]
    fn seed_workspace_w8_h6144_bf16_m42() {
        let ws = Workspace::mnnvl(8, 6144, ActDtype::Bf16, 42).unwrap();
        assert_eq!(ws.lamport_buffer_bytes, 1_179_648);
        assert_eq!(ws.total_bytes_per_rank, 3 * 1_179_648 + 2048);
        assert_eq!(
            ws.required_bytes(Strategy::OneShot, 40, 6144),
            Ok(3_932_160)
        );
        assert_eq!(ws.required_bytes(Strategy::TwoShot, 40, 6144), Ok(983_040));
        assert_eq!(ws.capacity_tokens(Strategy::OneShot, 6144), Ok(12));
        assert_eq!(ws.capacity_tokens(Strategy::TwoShot, 6144), Ok(48));
    }

    #[test]
    fn two_mib_allocation_gives_one_buffer_of_698368() {
        let ws = Workspace::mnnvl_from_allocation(8, 7168, ActDtype::Bf16, 2 * MIB).unwrap();
        assert_eq!(ws.lamport_buffer_bytes, 698_368);
        assert_eq!(ws.total_bytes_per_rank, 2 * MIB);
        assert_eq!(ws.capacity_tokens(Strategy::OneShot, 7168), Ok(6));
        assert_eq!(ws.capacity_tokens(Strategy::TwoShot, 7168), Ok(24));
        assert_eq!(ws.required_bytes(Strategy::OneShot, 7, 7168), Ok(802_816));
        // The public caller's mistake: whole allocation / bytes per token.
        assert_eq!(ws.total_bytes_per_rank / (7168 * 2), 146);
        assert_ne!(ws.capacity_tokens(Strategy::OneShot, 7168), Ok(146));
        assert_ne!(ws.capacity_tokens(Strategy::TwoShot, 7168), Ok(146));
    }

    #[test]
    fn buffer_alignment_is_enforced() {
        assert!(Workspace::mnnvl_from_buffer(8, 7168, ActDtype::Bf16, 698_368 + 16).is_err());
        assert!(Workspace::mnnvl_from_buffer(8, 7168, ActDtype::Bf16, 0).is_err());
        let mut ws = Workspace::mnnvl_from_buffer(8, 7168, ActDtype::Bf16, 698_368).unwrap();
        assert!(ws.problems().is_empty());
        ws.lamport_buffer_bytes += 16;
        assert_eq!(ws.problems().len(), 1);
        // Default sizing always rounds up to 32.
        for h in (256..=16384).step_by(8) {
            let ws = Workspace::mnnvl(8, h, ActDtype::Bf16, 37).unwrap();
            assert_eq!(ws.lamport_buffer_bytes % 32, 0, "H={h}");
        }
    }

    #[test]
    fn trtllm_lamport_clamped_one_shot_stops_at_130944() {
        let ws = Workspace::trtllm(2, 4096, ActDtype::F16, 200_000).unwrap();
        assert_eq!(ws.lamport_buffer_bytes, LAMPORT_MAX_COMM_BYTES);
        assert_eq!(ws.capacity_tokens(Strategy::OneShot, 4096), Ok(130_944));
        assert_eq!(ws.capacity_tokens(Strategy::TwoShot, 4096), Ok(200_000));
        assert!(ws.problems().is_empty());
        let small = Workspace::trtllm(2, 4096, ActDtype::F16, 130_944).unwrap();
        assert_eq!(small.lamport_buffer_bytes, LAMPORT_MAX_COMM_BYTES);
        assert_eq!(small.flag_bytes, 2 * 256 * 4);
        assert_eq!(
            small.total_bytes_per_rank,
            LAMPORT_MAX_COMM_BYTES + 2048 + 3 * LAMPORT_MAX_COMM_BYTES
        );
    }

    #[test]
    fn absurd_inputs_are_errors_not_panics() {
        assert!(Workspace::mnnvl(0, 4096, ActDtype::Bf16, 8).is_err());
        assert!(Workspace::mnnvl(8, 1 << 40, ActDtype::Bf16, 8).is_err());
        assert!(Workspace::mnnvl(8, 4096, ActDtype::Bf16, 0).is_err());
        assert!(matches!(
            Workspace::mnnvl(64, 65_536, ActDtype::Bf16, u64::MAX / 2),
            Err(PolicyError::Overflow { .. })
        ));
        assert!(Workspace::trtllm(16, 65_536, ActDtype::Bf16, u64::MAX).is_err());
        assert!(matches!(
            required_bytes(
                Backend::Mnnvl,
                Strategy::OneShot,
                0,
                4096,
                8,
                ActDtype::Bf16
            ),
            Err(PolicyError::InvalidTokens { t: 0, .. })
        ));
        assert!(Workspace::mnnvl_from_allocation(8, 4096, ActDtype::Bf16, 2048).is_err());
    }
}
