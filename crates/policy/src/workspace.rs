//! Workspace sizing (domain.md §5), the workspace layout of arfuse's kernels, and THE
//! capacity rule: whether one call fits ([`Workspace::misfit`]).
//!
//! One workspace serves one (all-reduce group, backend, dtype) and is sized for the
//! widest hidden size among every graph that shares it. Capacity is always checked
//! against ONE buffer (the workspace holds three Lamport buffers that rotate), never
//! against the whole allocation: a caller that divided a 2 MiB allocation by bytes per
//! token believed 146 tokens fit where one buffer held 698,368 bytes.
//!
//! Two kernel libraries have two layouts ([`KernelLibrary`]):
//! - arfuse's own kernels ([`ArfuseLayout`]): a [`STATE_BYTES`] state block, then
//!   three Lamport buffers of B bytes. One-shot AND two-shot run in the current buffer
//!   (two-shot: reduce-scatter slots, then all-gather rows, both Lamport-polled), so
//!   there is no second region; B is sized for the largest call the plan dispatches.
//!   The runtime allocates exactly this layout, from this definition.
//! - FlashInfer's `allreduce_fusion` kernels: FlashInfer's own formulas, exactly as
//!   domain.md §5 states them (mnnvl: three Lamport buffers plus a signal pad; trtllm:
//!   a comm buffer, barrier flags and a Lamport region).
//!
//! Every number derived from capacity (the planner's ranges and fallbacks, the checks of
//! capture sizes, `verify`, the IR's plan check on load, the runtime's check of every
//! fused range) goes through [`Workspace::misfit`] / [`Workspace::capacity_tokens`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::bytes;
use crate::error::{PolicyError, Result};
use crate::limits::{self, LAMPORT_MAX_COMM_BYTES};
use crate::strategy::Strategy;
use crate::target::{ActDtype, KernelLibrary};
use arfuse_abi::{BUFFER_ALIGN_BYTES, LAMPORT_BUFFER_COUNT, STATE_BYTES};

/// FlashInfer's Lamport buffer sizes are multiples of 32 bytes: stages must be 16-byte
/// aligned and a size of 16 mod 32 gave "misaligned address" (domain.md §5).
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
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workspace {
    /// The kernels whose layout this is.
    pub kernels: KernelLibrary,
    /// The backend the workspace belongs to (how peers map it).
    pub backend: Backend,
    /// Activation dtype it was sized for.
    pub dtype: ActDtype,
    /// W, ranks in the group.
    pub world_size: u32,
    /// Hidden size (elements) it was sized for: the widest among the graphs sharing it.
    pub hidden: u64,
    /// M, the tokens it was sized for; `None` for a buffer given from outside.
    pub max_tokens: Option<u64>,
    /// Bytes of ONE Lamport buffer (of three). Every arfuse call, and FlashInfer's
    /// one-shot calls and mnnvl two-shot calls, must fit in it.
    pub lamport_buffer_bytes: u64,
    /// FlashInfer trtllm's comm buffer used by its two-shot (bytes); 0 otherwise.
    pub comm_buffer_bytes: u64,
    /// FlashInfer trtllm's barrier flags (bytes); 0 otherwise.
    pub flag_bytes: u64,
    /// FlashInfer mnnvl's signal pad (bytes); 0 otherwise.
    pub signal_pad_bytes: u64,
    /// arfuse's state block ([`STATE_BYTES`]); 0 for FlashInfer's kernels.
    pub state_bytes: u64,
    /// Everything allocated per rank (bytes), before any allocator granularity rounding.
    pub total_bytes_per_rank: u64,
}

/// Byte offsets of an arfuse workspace of one rank (identical on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ArfuseLayout {
    /// The state block: `u32` words `[0]` call counter, `[1]` CTA arrivals, `[2..5)`
    /// bytes the last call using Lamport buffer i wrote into it.
    pub state_offset: u64,
    /// First Lamport buffer; buffer i starts at `lamport_offset + i * lamport_buffer_bytes`.
    pub lamport_offset: u64,
    /// Bytes of ONE Lamport buffer.
    pub lamport_buffer_bytes: u64,
    /// Bytes per rank (the whole allocation of one rank).
    pub bytes_per_rank: u64,
}

/// Why one fused call cannot run in a workspace ([`Workspace::misfit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misfit {
    /// FlashInfer's two-shot splits the T tokens over the W ranks and needs T >= W
    /// (every rank owns a token, as TensorRT-LLM and FlashInfer require; domain.md §4).
    /// arfuse's Lamport two-shot runs any T >= 1 (ranks without a token only take part
    /// in the reduce-scatter and the all-gather).
    BelowWorldSize {
        /// W.
        world_size: u32,
    },
    /// The call needs more bytes than the buffer its strategy uses.
    TooLarge {
        /// Bytes the call needs in that buffer.
        required_bytes: u64,
        /// Bytes the buffer holds.
        available_bytes: u64,
    },
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

/// Which buffer a fused call uses and how its bytes grow with T.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallBuffer {
    /// One Lamport buffer, `T*H*W*e` (one-shot, every library).
    LamportOneShot,
    /// One Lamport buffer, `2*ceil(T/W)*W*H*e` (arfuse's two-shot, FlashInfer mnnvl's).
    LamportTwoShot,
    /// FlashInfer trtllm's comm buffer, `W*T*H*e` (every rank's input staged).
    TrtllmComm,
}

fn call_buffer(kernels: KernelLibrary, backend: Backend, strategy: Strategy) -> Option<CallBuffer> {
    match (kernels, backend, strategy) {
        (_, _, Strategy::Unfused) => None,
        (_, _, Strategy::OneShot) => Some(CallBuffer::LamportOneShot),
        (KernelLibrary::Flashinfer, Backend::Trtllm, Strategy::TwoShot) => {
            Some(CallBuffer::TrtllmComm)
        }
        (_, _, Strategy::TwoShot) => Some(CallBuffer::LamportTwoShot),
    }
}

/// Bytes of ONE buffer a fused call of `t` tokens needs (domain.md §5): one-shot
/// `T*H*W*e` (the Lamport buffer); two-shot `2*ceil(T/W)*W*H*e` (the Lamport buffer;
/// arfuse's kernels on both backends, FlashInfer's mnnvl); FlashInfer trtllm two-shot
/// `W*T*H*e` (its comm buffer; every rank's input staged); unfused 0.
///
/// Errors: [`PolicyError::InvalidTokens`] for T = 0; [`PolicyError::InvalidField`]
/// for W = 0; [`PolicyError::InvalidHidden`]; [`PolicyError::Overflow`].
pub fn required_bytes(
    kernels: KernelLibrary,
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
    match call_buffer(kernels, backend, strategy) {
        None => Ok(0),
        Some(CallBuffer::LamportOneShot) => bytes::mul(t, per_token, "one-shot bytes T*H*W*e"),
        Some(CallBuffer::TrtllmComm) => bytes::mul(t, per_token, "two-shot bytes W*T*H*e"),
        Some(CallBuffer::LamportTwoShot) => {
            let per_rank = bytes::ceil_div(t, u64::from(w), "ceil(T/W)")?;
            bytes::product(
                &[TWO_SHOT_STAGES, per_rank, per_token],
                "two-shot bytes 2*ceil(T/W)*W*H*e",
            )
        }
    }
}

impl Workspace {
    /// FlashInfer's default workspace of `backend` for M = `max_tokens` tokens
    /// (domain.md §5): see [`Workspace::flashinfer_mnnvl`] and
    /// [`Workspace::flashinfer_trtllm`].
    ///
    /// Errors: as those constructors.
    pub fn flashinfer(
        backend: Backend,
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        max_tokens: u64,
    ) -> Result<Workspace> {
        match backend {
            Backend::Mnnvl => Workspace::flashinfer_mnnvl(w, hidden, dtype, max_tokens),
            Backend::Trtllm => Workspace::flashinfer_trtllm(w, hidden, dtype, max_tokens),
        }
    }

    /// FlashInfer's default mnnvl sizing for M tokens (domain.md §5):
    /// `B = max(min(floor(1 MiB / (W*e*H)), M) * H*W*e, 2*ceil(M/W)*W*H*e)` rounded up to
    /// 32 bytes; three buffers plus the 2,048-byte signal pad per rank.
    /// W=8, H=6144, bf16, M=42 -> B = 1,179,648.
    ///
    /// Errors: [`PolicyError::InvalidField`] (W = 0), [`PolicyError::InvalidHidden`],
    /// [`PolicyError::InvalidTokens`] (M = 0), [`PolicyError::Overflow`].
    pub fn flashinfer_mnnvl(
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        max_tokens: u64,
    ) -> Result<Workspace> {
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
            KernelLibrary::Flashinfer,
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

    /// A FlashInfer mnnvl workspace sized so one-shot fits every T up to M:
    /// `B = M*H*W*e` rounded up to 32 bytes (domain.md §5). Used by deterministic plans.
    ///
    /// Errors: as [`Workspace::flashinfer_mnnvl`].
    pub fn flashinfer_mnnvl_one_shot_everywhere(
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        max_tokens: u64,
    ) -> Result<Workspace> {
        check_args(w, hidden, dtype)?;
        check_tokens(max_tokens, "max_tokens")?;
        let need = required_bytes(
            KernelLibrary::Flashinfer,
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

    /// A FlashInfer mnnvl workspace whose ONE Lamport buffer holds `buffer_bytes`,
    /// given from outside (for example by an engine that allocated it).
    ///
    /// Errors: [`PolicyError::InvalidField`] (`buffer_bytes`) when it is 0 or not a
    /// multiple of 32 (the rotating stages would be misaligned); others as
    /// [`Workspace::flashinfer_mnnvl`].
    pub fn flashinfer_mnnvl_from_buffer(
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        buffer_bytes: u64,
    ) -> Result<Workspace> {
        check_args(w, hidden, dtype)?;
        check_buffer(
            buffer_bytes,
            LAMPORT_ALIGN_BYTES,
            "a size of 16 mod 32 gave \"misaligned address\"",
        )?;
        Self::mnnvl_with_buffer(w, hidden, dtype, None, buffer_bytes)
    }

    /// A FlashInfer mnnvl workspace from the size of its whole per-rank allocation: the
    /// allocation less the 2,048-byte signal pad, split in three, rounded down to 32
    /// bytes. A 2 MiB allocation gives ONE buffer of 698,368 bytes (domain.md §5).
    ///
    /// Errors: [`PolicyError::InvalidField`] (`allocation_bytes`) when no aligned
    /// buffer fits; others as [`Workspace::flashinfer_mnnvl`].
    pub fn flashinfer_mnnvl_from_allocation(
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
        let mut ws = Self::flashinfer_mnnvl_from_buffer(w, hidden, dtype, buffer)?;
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
            kernels: KernelLibrary::Flashinfer,
            backend: Backend::Mnnvl,
            dtype,
            world_size: w,
            hidden,
            max_tokens,
            lamport_buffer_bytes: buffer,
            comm_buffer_bytes: 0,
            flag_bytes: 0,
            signal_pad_bytes: MNNVL_SIGNAL_PAD_BYTES,
            state_bytes: 0,
            total_bytes_per_rank: total,
        })
    }

    /// FlashInfer's trtllm workspace for M tokens (domain.md §5): comm buffer
    /// `W*M*H*e`, barrier flags `W*256*4`, Lamport region of three buffers of `W*M*H*e`
    /// each. One Lamport buffer is clamped to [`LAMPORT_MAX_COMM_BYTES`]; above it
    /// one-shot cannot run, and the per-T checks then refuse one-shot beyond the limit
    /// (H=4096, fp16, W=2: one-shot up to T = 130,944 and no further).
    ///
    /// The sources write the comm buffer as `W*M*H*2` (sizeof(half)); arfuse uses `e`,
    /// which is the same for 16-bit types and not undersized for f32.
    ///
    /// Errors: as [`Workspace::flashinfer_mnnvl`].
    pub fn flashinfer_trtllm(
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        max_tokens: u64,
    ) -> Result<Workspace> {
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
            kernels: KernelLibrary::Flashinfer,
            backend: Backend::Trtllm,
            dtype,
            world_size: w,
            hidden,
            max_tokens: Some(max_tokens),
            lamport_buffer_bytes: lamport,
            comm_buffer_bytes: comm_size,
            flag_bytes: flags,
            signal_pad_bytes: 0,
            state_bytes: 0,
            total_bytes_per_rank: total,
        })
    }

    /// A workspace of arfuse's kernels ([`ArfuseLayout`]) whose ONE Lamport buffer holds
    /// `buffer_bytes`: [`STATE_BYTES`] + 3 * `buffer_bytes` per rank, on either
    /// backend (the backend only decides how peers map it). `max_tokens` is M when the
    /// planner sized it, `None` when the buffer was given from outside.
    ///
    /// Errors: [`PolicyError::InvalidField`] (`buffer_bytes`) when it is 0, not a
    /// multiple of [`BUFFER_ALIGN_BYTES`] or above [`LAMPORT_MAX_COMM_BYTES`];
    /// [`PolicyError::InvalidField`] (W = 0), [`PolicyError::InvalidHidden`],
    /// [`PolicyError::Overflow`].
    pub fn arfuse(
        backend: Backend,
        w: u32,
        hidden: u64,
        dtype: ActDtype,
        max_tokens: Option<u64>,
        buffer_bytes: u64,
    ) -> Result<Workspace> {
        check_args(w, hidden, dtype)?;
        check_buffer(
            buffer_bytes,
            BUFFER_ALIGN_BYTES,
            "arfuse's buffers start on 128-byte lines",
        )?;
        if buffer_bytes > LAMPORT_MAX_COMM_BYTES {
            return Err(PolicyError::InvalidField {
                field: "buffer_bytes",
                value: buffer_bytes.to_string(),
                reason: format!(
                    "one Lamport buffer may hold at most {LAMPORT_MAX_COMM_BYTES} bytes \
                     (INT32_MAX rounded down to 2 MiB; an overflow above it caused illegal \
                     memory accesses in public kernels)"
                ),
            });
        }
        let total = bytes::add(
            STATE_BYTES,
            bytes::mul(buffer_bytes, LAMPORT_BUFFER_COUNT, "arfuse Lamport buffers")?,
            "arfuse workspace",
        )?;
        Ok(Workspace {
            kernels: KernelLibrary::Arfuse,
            backend,
            dtype,
            world_size: w,
            hidden,
            max_tokens,
            lamport_buffer_bytes: buffer_bytes,
            comm_buffer_bytes: 0,
            flag_bytes: 0,
            signal_pad_bytes: 0,
            state_bytes: STATE_BYTES,
            total_bytes_per_rank: total,
        })
    }

    /// The smallest arfuse Lamport buffer that holds a call of `required_bytes`:
    /// rounded up to [`BUFFER_ALIGN_BYTES`] (at least one line).
    ///
    /// Errors: [`PolicyError::Overflow`].
    pub fn arfuse_buffer_for(required_bytes: u64) -> Result<u64> {
        bytes::round_up(
            required_bytes.max(1),
            BUFFER_ALIGN_BYTES,
            "arfuse Lamport buffer",
        )
    }

    /// The byte offsets of an arfuse workspace; `None` for FlashInfer's kernels (their
    /// layout is FlashInfer's own; arfuse only sizes it).
    pub fn arfuse_layout(&self) -> Option<ArfuseLayout> {
        (self.kernels == KernelLibrary::Arfuse).then_some(ArfuseLayout {
            state_offset: 0,
            lamport_offset: self.state_bytes,
            lamport_buffer_bytes: self.lamport_buffer_bytes,
            bytes_per_rank: self.total_bytes_per_rank,
        })
    }

    /// Bytes available to one call of `strategy` (bytes): one Lamport buffer, except
    /// FlashInfer trtllm's two-shot (its comm buffer); unfused -> 0 (it needs none).
    pub fn available_bytes(&self, strategy: Strategy) -> u64 {
        match call_buffer(self.kernels, self.backend, strategy) {
            None => 0,
            Some(CallBuffer::TrtllmComm) => self.comm_buffer_bytes,
            Some(CallBuffer::LamportOneShot | CallBuffer::LamportTwoShot) => {
                self.lamport_buffer_bytes
            }
        }
    }

    /// Bytes one call of `t` tokens at `hidden` needs under `strategy` with this
    /// workspace's kernels, backend, group and dtype (see [`required_bytes`]).
    ///
    /// Errors: as [`required_bytes`].
    pub fn required_bytes(&self, strategy: Strategy, t: u64, hidden: u64) -> Result<u64> {
        required_bytes(
            self.kernels,
            self.backend,
            strategy,
            t,
            hidden,
            self.world_size,
            self.dtype,
        )
    }

    /// THE capacity rule: why a call of `t` tokens at `hidden` with `strategy` cannot
    /// run in this workspace, or `None` when it can (always `None` for unfused).
    /// FlashInfer's two-shot needs T >= W; a fused call must fit the buffer its
    /// strategy uses.
    ///
    /// Errors: as [`required_bytes`].
    pub fn misfit(&self, strategy: Strategy, t: u64, hidden: u64) -> Result<Option<Misfit>> {
        if !strategy.is_fused() {
            return Ok(None);
        }
        if self.kernels == KernelLibrary::Flashinfer
            && strategy == Strategy::TwoShot
            && t < u64::from(self.world_size)
        {
            return Ok(Some(Misfit::BelowWorldSize {
                world_size: self.world_size,
            }));
        }
        let need = self.required_bytes(strategy, t, hidden)?;
        let available = self.available_bytes(strategy);
        Ok((need > available).then_some(Misfit::TooLarge {
            required_bytes: need,
            available_bytes: available,
        }))
    }

    /// Largest T (tokens) whose `strategy` call at `hidden` fits this workspace's buffer
    /// (0 when none): the closed form of the byte test of [`Workspace::misfit`], which
    /// holds exactly for `T <= capacity_tokens` (and, for FlashInfer's two-shot, T >= W). For
    /// [`Strategy::Unfused`], `u64::MAX`. Never "allocation / bytes per token".
    ///
    /// Errors: [`PolicyError::InvalidHidden`], [`PolicyError::Overflow`].
    pub fn capacity_tokens(&self, strategy: Strategy, hidden: u64) -> Result<u64> {
        check_args(self.world_size, hidden, self.dtype)?;
        let per_token = group_row_bytes(hidden, self.world_size, self.dtype)?;
        let avail = self.available_bytes(strategy);
        match call_buffer(self.kernels, self.backend, strategy) {
            None => Ok(u64::MAX),
            Some(CallBuffer::LamportOneShot | CallBuffer::TrtllmComm) => {
                bytes::floor_div(avail, per_token, "capacity tokens")
            }
            Some(CallBuffer::LamportTwoShot) => {
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

    /// Problems of the workspace itself, as sentences (empty when sound): W = 0 or an
    /// invalid hidden size; a Lamport buffer of 0 bytes, not a multiple of its
    /// library's alignment, or above [`LAMPORT_MAX_COMM_BYTES`] (arfuse, FlashInfer
    /// trtllm); regions of another library; a total that is not the layout's (arfuse:
    /// exactly state + 3 buffers; FlashInfer: at least its regions).
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Err(e) = check_args(self.world_size, self.hidden, self.dtype) {
            out.push(e.to_string());
        }
        let align = match self.kernels {
            KernelLibrary::Arfuse => BUFFER_ALIGN_BYTES,
            KernelLibrary::Flashinfer => LAMPORT_ALIGN_BYTES,
        };
        if self.lamport_buffer_bytes == 0 {
            out.push("one Lamport buffer of 0 bytes holds no call".to_string());
        } else if self.lamport_buffer_bytes % align != 0 {
            out.push(format!(
                "one Lamport buffer of {} bytes is not a multiple of {align} bytes \
                 (the rotating buffers would be misaligned)",
                self.lamport_buffer_bytes
            ));
        }
        let clamped = self.kernels == KernelLibrary::Arfuse || self.backend == Backend::Trtllm;
        if clamped && self.lamport_buffer_bytes > LAMPORT_MAX_COMM_BYTES {
            out.push(format!(
                "one Lamport buffer of {} bytes exceeds {LAMPORT_MAX_COMM_BYTES} bytes \
                 (INT32_MAX rounded down to 2 MiB)",
                self.lamport_buffer_bytes
            ));
        }
        out.extend(self.region_problems());
        out
    }

    /// The regions a library does not have must be 0, and the total must cover the
    /// regions it has.
    fn region_problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let (state, comm, flags, pad) = match (self.kernels, self.backend) {
            (KernelLibrary::Arfuse, _) => (STATE_BYTES, 0, 0, 0),
            (KernelLibrary::Flashinfer, Backend::Mnnvl) => (0, 0, 0, MNNVL_SIGNAL_PAD_BYTES),
            (KernelLibrary::Flashinfer, Backend::Trtllm) => {
                let flags = u64::from(self.world_size)
                    .saturating_mul(TRTLLM_BARRIER_FLAG_COUNT * TRTLLM_FLAG_BYTES);
                (0, self.comm_buffer_bytes, flags, 0)
            }
        };
        let fields = [
            ("state_bytes", self.state_bytes, state),
            ("comm_buffer_bytes", self.comm_buffer_bytes, comm),
            ("flag_bytes", self.flag_bytes, flags),
            ("signal_pad_bytes", self.signal_pad_bytes, pad),
        ];
        for (name, have, want) in fields {
            if have != want {
                out.push(format!(
                    "{name} is {have} bytes; a {} {} workspace has {want}",
                    self.kernels, self.backend
                ));
            }
        }
        let regions = [state, comm, flags, pad]
            .into_iter()
            .try_fold(0u64, u64::checked_add)
            .and_then(|r| {
                self.lamport_buffer_bytes
                    .checked_mul(LAMPORT_BUFFER_COUNT)
                    .and_then(|l| l.checked_add(r))
            });
        match regions {
            None => out.push("the regions' byte count overflows u64".to_string()),
            Some(r) if self.kernels == KernelLibrary::Arfuse && self.total_bytes_per_rank != r => {
                out.push(format!(
                    "total_bytes_per_rank is {} but arfuse's layout (state + 3 Lamport \
                     buffers) is {r} bytes",
                    self.total_bytes_per_rank
                ))
            }
            Some(r) if self.total_bytes_per_rank < r => out.push(format!(
                "total_bytes_per_rank {} is less than its regions' {r} bytes",
                self.total_bytes_per_rank
            )),
            Some(_) => {}
        }
        out
    }
}

fn check_buffer(buffer_bytes: u64, align: u64, why: &str) -> Result<()> {
    if buffer_bytes == 0 || buffer_bytes % align != 0 {
        return Err(PolicyError::InvalidField {
            field: "buffer_bytes",
            value: buffer_bytes.to_string(),
            reason: format!(
                "one Lamport buffer must be a non-zero multiple of {align} bytes ({why})"
            ),
        });
    }
    Ok(())
}

impl fmt::Display for Workspace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} workspace (W={}, H={}, {}",
            self.kernels, self.backend, self.world_size, self.hidden, self.dtype
        )?;
        if let Some(m) = self.max_tokens {
            write!(f, ", M={m}")?;
        }
        write!(
            f,
            "): one Lamport buffer {} bytes (of {LAMPORT_BUFFER_COUNT})",
            self.lamport_buffer_bytes
        )?;
        match (self.kernels, self.backend) {
            (KernelLibrary::Arfuse, _) => write!(f, ", state {} bytes", self.state_bytes)?,
            (KernelLibrary::Flashinfer, Backend::Trtllm) => write!(
                f,
                ", comm buffer {} bytes, flags {} bytes",
                self.comm_buffer_bytes, self.flag_bytes
            )?,
            (KernelLibrary::Flashinfer, Backend::Mnnvl) => {
                write!(f, ", signal pad {} bytes", self.signal_pad_bytes)?
            }
        }
        write!(
            f,
            "; {} bytes allocated per rank",
            self.total_bytes_per_rank
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::MIB;

    #[test]
    fn seed_workspace_w8_h6144_bf16_m42() {
        let ws = Workspace::flashinfer_mnnvl(8, 6144, ActDtype::Bf16, 42).unwrap();
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
        let ws =
            Workspace::flashinfer_mnnvl_from_allocation(8, 7168, ActDtype::Bf16, 2 * MIB).unwrap();
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
        assert!(
            Workspace::flashinfer_mnnvl_from_buffer(8, 7168, ActDtype::Bf16, 698_368 + 16).is_err()
        );
        assert!(Workspace::flashinfer_mnnvl_from_buffer(8, 7168, ActDtype::Bf16, 0).is_err());
        let mut ws =
            Workspace::flashinfer_mnnvl_from_buffer(8, 7168, ActDtype::Bf16, 698_368).unwrap();
        assert!(ws.problems().is_empty());
        ws.lamport_buffer_bytes += 16;
        let problems = ws.problems();
        assert!(
            problems.iter().any(|p| p.contains("not a multiple of 32")),
            "{problems:?}"
        );
        // The three grown buffers no longer fit the stated allocation either.
        assert!(
            problems.iter().any(|p| p.contains("less than its regions")),
            "{problems:?}"
        );
        // Default sizing always rounds up to 32.
        for h in (256..=16384).step_by(8) {
            let ws = Workspace::flashinfer_mnnvl(8, h, ActDtype::Bf16, 37).unwrap();
            assert_eq!(ws.lamport_buffer_bytes % 32, 0, "H={h}");
        }
    }

    #[test]
    fn trtllm_lamport_clamped_one_shot_stops_at_130944() {
        let ws = Workspace::flashinfer_trtllm(2, 4096, ActDtype::F16, 200_000).unwrap();
        assert_eq!(ws.lamport_buffer_bytes, LAMPORT_MAX_COMM_BYTES);
        assert_eq!(ws.capacity_tokens(Strategy::OneShot, 4096), Ok(130_944));
        assert_eq!(ws.capacity_tokens(Strategy::TwoShot, 4096), Ok(200_000));
        assert!(ws.problems().is_empty());
        let small = Workspace::flashinfer_trtllm(2, 4096, ActDtype::F16, 130_944).unwrap();
        assert_eq!(small.lamport_buffer_bytes, LAMPORT_MAX_COMM_BYTES);
        assert_eq!(small.flag_bytes, 2 * 256 * 4);
        assert_eq!(
            small.total_bytes_per_rank,
            LAMPORT_MAX_COMM_BYTES + 2048 + 3 * LAMPORT_MAX_COMM_BYTES
        );
    }

    #[test]
    fn absurd_inputs_are_errors_not_panics() {
        assert!(Workspace::flashinfer_mnnvl(0, 4096, ActDtype::Bf16, 8).is_err());
        assert!(Workspace::flashinfer_mnnvl(8, 1 << 40, ActDtype::Bf16, 8).is_err());
        assert!(Workspace::flashinfer_mnnvl(8, 4096, ActDtype::Bf16, 0).is_err());
        assert!(matches!(
            Workspace::flashinfer_mnnvl(64, 65_536, ActDtype::Bf16, u64::MAX / 2),
            Err(PolicyError::Overflow { .. })
        ));
        assert!(Workspace::flashinfer_trtllm(16, 65_536, ActDtype::Bf16, u64::MAX).is_err());
        assert!(matches!(
            required_bytes(
                KernelLibrary::Flashinfer,
                Backend::Mnnvl,
                Strategy::OneShot,
                0,
                4096,
                8,
                ActDtype::Bf16
            ),
            Err(PolicyError::InvalidTokens { t: 0, .. })
        ));
        assert!(
            Workspace::flashinfer_mnnvl_from_allocation(8, 4096, ActDtype::Bf16, 2048).is_err()
        );
    }

    /// domain.md §5's seed case with arfuse's kernels: one-shot to T=10 (983,040 bytes)
    /// and two-shot to M=42 (2*6*8*12,288 = 1,179,648 bytes) share ONE buffer.
    #[test]
    fn arfuse_layout_is_state_plus_three_buffers() {
        let b = Workspace::arfuse_buffer_for(1_179_648).unwrap();
        assert_eq!(b, 1_179_648); // already a multiple of 128
        let ws = Workspace::arfuse(Backend::Mnnvl, 8, 6144, ActDtype::Bf16, Some(42), b).unwrap();
        assert_eq!(ws.total_bytes_per_rank, 256 + 3 * 1_179_648);
        assert!(ws.problems().is_empty(), "{:?}", ws.problems());
        let l = ws.arfuse_layout().unwrap();
        assert_eq!(
            (l.state_offset, l.lamport_offset, l.bytes_per_rank),
            (0, 256, 3_539_200)
        );
        // Both strategies use the Lamport buffer, on either backend.
        for backend in [Backend::Mnnvl, Backend::Trtllm] {
            let ws = Workspace::arfuse(backend, 8, 6144, ActDtype::Bf16, Some(42), b).unwrap();
            assert_eq!(ws.available_bytes(Strategy::TwoShot), 1_179_648);
            assert_eq!(ws.required_bytes(Strategy::OneShot, 10, 6144), Ok(983_040));
            assert_eq!(
                ws.required_bytes(Strategy::TwoShot, 42, 6144),
                Ok(1_179_648)
            );
            assert_eq!(ws.capacity_tokens(Strategy::OneShot, 6144), Ok(12));
            assert_eq!(ws.capacity_tokens(Strategy::TwoShot, 6144), Ok(48));
            assert_eq!(ws.misfit(Strategy::TwoShot, 48, 6144), Ok(None));
            assert_eq!(
                ws.misfit(Strategy::TwoShot, 49, 6144),
                Ok(Some(Misfit::TooLarge {
                    required_bytes: 2 * 7 * 8 * 12_288,
                    available_bytes: 1_179_648
                }))
            );
            // arfuse's Lamport two-shot runs T < W too (2 * 1 * 8 * 12,288 bytes).
            assert_eq!(ws.misfit(Strategy::TwoShot, 7, 6144), Ok(None));
            assert_eq!(ws.required_bytes(Strategy::TwoShot, 7, 6144), Ok(196_608));
        }
        // FlashInfer's kernels have no arfuse layout.
        let fi = Workspace::flashinfer_mnnvl(8, 6144, ActDtype::Bf16, 42).unwrap();
        assert_eq!(fi.arfuse_layout(), None);
        assert_eq!(
            fi.misfit(Strategy::TwoShot, 7, 6144),
            Ok(Some(Misfit::BelowWorldSize { world_size: 8 }))
        );
        assert_eq!(fi.total_bytes_per_rank, 3_540_992);
    }

    #[test]
    fn arfuse_buffers_are_line_aligned_and_bounded() {
        assert_eq!(Workspace::arfuse_buffer_for(1), Ok(128));
        assert_eq!(Workspace::arfuse_buffer_for(129), Ok(256));
        assert_eq!(Workspace::arfuse_buffer_for(0), Ok(128));
        let mk = |b| Workspace::arfuse(Backend::Mnnvl, 8, 4096, ActDtype::Bf16, None, b);
        assert!(mk(0).is_err());
        assert!(mk(96).is_err()); // a multiple of 32, not of 128
        assert!(mk(LAMPORT_MAX_COMM_BYTES).is_ok());
        assert!(mk(LAMPORT_MAX_COMM_BYTES + 128).is_err());
        // A hand-edited total or a region of another library is a problem.
        let mut ws = mk(4096).unwrap();
        ws.total_bytes_per_rank += 1;
        assert_eq!(ws.problems().len(), 1, "{:?}", ws.problems());
        let mut ws = mk(4096).unwrap();
        ws.signal_pad_bytes = MNNVL_SIGNAL_PAD_BYTES;
        assert!(ws.problems().iter().any(|p| p.contains("signal_pad_bytes")));
    }

    /// The byte test of `misfit` and the closed form of `capacity_tokens` agree at every
    /// T around the boundary, for every library, backend and strategy.
    #[test]
    fn misfit_and_capacity_agree() {
        let workspaces = [
            Workspace::arfuse(Backend::Mnnvl, 4, 2880, ActDtype::Bf16, None, 640 * 128).unwrap(),
            Workspace::arfuse(Backend::Trtllm, 8, 7168, ActDtype::F32, None, 4096 * 128).unwrap(),
            Workspace::flashinfer_mnnvl(8, 7168, ActDtype::Bf16, 73).unwrap(),
            Workspace::flashinfer_trtllm(4, 5120, ActDtype::F16, 37).unwrap(),
        ];
        for ws in &workspaces {
            for s in [Strategy::OneShot, Strategy::TwoShot] {
                let cap = ws.capacity_tokens(s, ws.hidden).unwrap();
                for t in 1..=cap + 2 * u64::from(ws.world_size) {
                    let fits = !matches!(
                        ws.misfit(s, t, ws.hidden).unwrap(),
                        Some(Misfit::TooLarge { .. })
                    );
                    assert_eq!(fits, t <= cap, "{ws} {s} T={t} capacity {cap}");
                }
            }
        }
    }
}
