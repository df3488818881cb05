//! Byte sizes of the per-rank workspace of the fused kernels. All arithmetic is
//! checked (`u64`), never wrapped. (The quant output sizes are the reference's, the
//! one definition: `arfuse_reference::numerics::quant::{group_scale_bytes,
//! nvfp4_data_bytes, nvfp4_scale_bytes}`; `check::Case::output_bytes` uses them.)
//!
//! Per-rank workspace (offsets identical on every rank; regions 256-byte aligned):
//!
//! | region    | bytes                          | use |
//! |-----------|--------------------------------|-----|
//! | os_state  | 64                             | one-shot call counter, arrivals, bytes used per buffer |
//! | ts_state  | 256 * 4                        | two-shot epoch per CTA |
//! | ts_flags  | 256 * W * 4                    | two-shot barrier flags (domain.md section 5: W*256*4) |
//! | lamport   | 3 * B                          | one-shot Lamport buffers, B = one-shot tokens * W * H * e rounded up to 128 |
//! | scatter   | W * ceil(M / W) * H * e        | two-shot reduce-scatter inbox |
//! | gather    | M * H * e                      | two-shot all-gather inbox |
//!
//! A one-shot call of T tokens needs `T * W * H * e` bytes of ONE Lamport buffer
//! (capacity is always checked against one buffer, never the allocation).

use crate::error::{Error, Result};
use crate::variants::{Dtype, Strategy};

/// Largest Lamport comm size `W * M * H * e` (INT32_MAX rounded down to 2 MiB,
/// domain.md section 5); above it one-shot is impossible.
pub const MAX_LAMPORT_BYTES: u64 = 2_145_386_496;
/// CTAs per rank that have two-shot barrier flags (`ARF_MAX_CTAS` in the kernels).
pub const MAX_CTAS: u64 = 256;
/// Alignment of every workspace region, bytes.
pub const REGION_ALIGN: u64 = 256;
/// Alignment of one Lamport buffer (stages must stay 16-byte aligned; 16 mod 32 gave
/// "misaligned address" in public code, so use a generous multiple).
pub const LAMPORT_ALIGN: u64 = 128;

/// What a workspace must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkspaceRequest {
    /// World size W.
    pub world: u32,
    /// Hidden size H (elements; the max over models sharing the workspace).
    pub hidden: u32,
    /// Activation dtype.
    pub dtype: Dtype,
    /// Max tokens M of any fused call.
    pub max_tokens: u32,
    /// Max tokens of any ONE-SHOT call (<= M); sizes the Lamport buffers.
    pub oneshot_max_tokens: u32,
}

/// Byte offsets of the workspace regions of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceLayout {
    /// The request it was computed from.
    pub request: WorkspaceRequest,
    /// One-shot state (`u32[16]`).
    pub off_os_state: u64,
    /// Two-shot epochs (`u32[256]`).
    pub off_ts_state: u64,
    /// Two-shot flags (`u32[256][W]`).
    pub off_ts_flags: u64,
    /// First Lamport buffer.
    pub off_lamport: u64,
    /// Bytes of ONE Lamport buffer (B).
    pub lamport_stride: u64,
    /// Two-shot scatter inbox.
    pub off_scatter: u64,
    /// Two-shot gather inbox.
    pub off_gather: u64,
    /// Bytes per rank (a multiple of [`REGION_ALIGN`]).
    pub per_rank_bytes: u64,
}

fn round_up(x: u64, a: u64) -> Result<u64> {
    x.checked_add(a - 1)
        .map(|y| y / a * a)
        .ok_or(Error::Overflow("round_up"))
}

fn mul(a: u64, b: u64, what: &'static str) -> Result<u64> {
    a.checked_mul(b).ok_or(Error::Overflow(what))
}

impl WorkspaceLayout {
    /// Computes the layout.
    ///
    /// # Errors
    /// [`Error::Invalid`] for W not in {2, 4, 8, 16}, H * e not a multiple of 16,
    /// M = 0 or one-shot tokens > M; [`Error::Unsupported`] when the Lamport comm size
    /// exceeds [`MAX_LAMPORT_BYTES`]; [`Error::Overflow`] on absurd sizes.
    pub fn new(req: WorkspaceRequest) -> Result<WorkspaceLayout> {
        if !crate::variants::WORLD_SIZES.contains(&req.world) {
            return Err(Error::Invalid(format!(
                "world size {} not in {{2, 4, 8, 16}}",
                req.world
            )));
        }
        let e = req.dtype.bytes() as u64;
        let row = mul(u64::from(req.hidden), e, "row bytes")?;
        if row == 0 || row % 16 != 0 {
            return Err(Error::Invalid(format!(
                "H * e = {row} bytes must be a positive multiple of 16 (16-byte vectors)"
            )));
        }
        if req.max_tokens == 0 || req.oneshot_max_tokens > req.max_tokens {
            return Err(Error::Invalid(format!(
                "need 0 < one-shot tokens ({}) <= M ({})",
                req.oneshot_max_tokens, req.max_tokens
            )));
        }
        let w = u64::from(req.world);
        let m = u64::from(req.max_tokens);
        let lam_comm = mul(
            mul(u64::from(req.oneshot_max_tokens), w, "lamport")?,
            row,
            "lamport",
        )?;
        if lam_comm > MAX_LAMPORT_BYTES {
            return Err(Error::Unsupported(format!(
                "one-shot comm size {lam_comm} B exceeds {MAX_LAMPORT_BYTES} B (INT32_MAX rounded to 2 MiB); lower the one-shot token limit"
            )));
        }
        let lamport_stride = round_up(lam_comm.max(16), LAMPORT_ALIGN)?;
        let mut off = 0u64;
        let off_os_state = off;
        off = round_up(off + 64, REGION_ALIGN)?;
        let off_ts_state = off;
        off = round_up(off + MAX_CTAS * 4, REGION_ALIGN)?;
        let off_ts_flags = off;
        off = round_up(off + mul(MAX_CTAS * 4, w, "flags")?, REGION_ALIGN)?;
        let off_lamport = off;
        off = round_up(
            off.checked_add(mul(lamport_stride, 3, "lamport")?)
                .ok_or(Error::Overflow("lamport"))?,
            REGION_ALIGN,
        )?;
        let off_scatter = off;
        let scatter = mul(mul(w, m.div_ceil(w), "scatter")?, row, "scatter")?;
        off = round_up(
            off.checked_add(scatter).ok_or(Error::Overflow("scatter"))?,
            REGION_ALIGN,
        )?;
        let off_gather = off;
        let gather = mul(m, row, "gather")?;
        off = round_up(
            off.checked_add(gather).ok_or(Error::Overflow("gather"))?,
            REGION_ALIGN,
        )?;
        Ok(WorkspaceLayout {
            request: req,
            off_os_state,
            off_ts_state,
            off_ts_flags,
            off_lamport,
            lamport_stride,
            off_scatter,
            off_gather,
            per_rank_bytes: off,
        })
    }

    /// Bytes of ONE Lamport buffer a one-shot call of `tokens` needs: `T * W * H * e`.
    pub fn oneshot_bytes(&self, tokens: u32) -> Result<u64> {
        let r = self.request;
        mul(
            mul(u64::from(tokens), u64::from(r.world), "one-shot bytes")?,
            mul(
                u64::from(r.hidden),
                r.dtype.bytes() as u64,
                "one-shot bytes",
            )?,
            "one-shot bytes",
        )
    }

    /// Checks that a call of `tokens` with `strategy` fits this workspace.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the required and available bytes.
    pub fn check_call(&self, strategy: Strategy, tokens: u32) -> Result<()> {
        if tokens == 0 {
            return Err(Error::Invalid("a call needs T >= 1".into()));
        }
        if tokens > self.request.max_tokens {
            return Err(Error::Invalid(format!(
                "T = {tokens} exceeds the workspace's M = {}",
                self.request.max_tokens
            )));
        }
        if strategy == Strategy::OneShot {
            let need = self.oneshot_bytes(tokens)?;
            if need > self.lamport_stride {
                return Err(Error::Invalid(format!(
                    "one-shot at T = {tokens} needs {need} bytes of one Lamport buffer; it has {}",
                    self.lamport_stride
                )));
            }
        }
        Ok(())
    }

    /// Bytes of all W virtual ranks in one allocation.
    pub fn virtual_bytes(&self) -> Result<u64> {
        mul(
            self.per_rank_bytes,
            u64::from(self.request.world),
            "virtual workspace",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(world: u32, hidden: u32, m: u32, os: u32) -> WorkspaceRequest {
        WorkspaceRequest {
            world,
            hidden,
            dtype: Dtype::Bf16,
            max_tokens: m,
            oneshot_max_tokens: os,
        }
    }

    #[test]
    fn seed_case_h200_w8_h6144() {
        // domain.md section 5: W=8, H=6144, bf16, M=42. A one-shot T=40 needs
        // 3,932,160 bytes of ONE buffer; sized for one-shot up to T=10 it must refuse.
        let l = WorkspaceLayout::new(req(8, 6144, 42, 10)).unwrap();
        assert_eq!(l.lamport_stride, 983_040);
        assert_eq!(l.oneshot_bytes(40).unwrap(), 3_932_160);
        let err = l.check_call(Strategy::OneShot, 40).unwrap_err().to_string();
        assert!(err.contains("3932160") && err.contains("983040"), "{err}");
        l.check_call(Strategy::TwoShot, 40).unwrap();
        l.check_call(Strategy::OneShot, 10).unwrap();
        assert!(l.check_call(Strategy::TwoShot, 43).is_err());
        // Regions are ordered, aligned, disjoint.
        let offs = [
            l.off_os_state,
            l.off_ts_state,
            l.off_ts_flags,
            l.off_lamport,
            l.off_scatter,
            l.off_gather,
        ];
        assert!(offs.windows(2).all(|w| w[0] < w[1]));
        assert!(offs.iter().all(|o| o % REGION_ALIGN == 0));
        assert_eq!(l.off_scatter - l.off_lamport, 3 * 983_040);
        assert_eq!(l.per_rank_bytes - l.off_gather, 42 * 6144 * 2);
        assert_eq!(l.off_lamport - l.off_ts_flags, 256 * 8 * 4);
    }

    #[test]
    fn lamport_limit_and_bad_inputs() {
        // H=4096 fp16 W=2: M <= 130,944 fits, 130,945 does not.
        let mut r = req(2, 4096, 130_944, 130_944);
        r.dtype = Dtype::F16;
        assert!(WorkspaceLayout::new(r).is_ok());
        r.max_tokens = 130_945;
        r.oneshot_max_tokens = 130_945;
        assert!(matches!(
            WorkspaceLayout::new(r),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            WorkspaceLayout::new(req(3, 4096, 8, 8)),
            Err(Error::Invalid(_))
        ));
        assert!(matches!(
            WorkspaceLayout::new(req(8, 4, 8, 8)),
            Err(Error::Invalid(_))
        ));
        assert!(matches!(
            WorkspaceLayout::new(req(8, 4096, 8, 9)),
            Err(Error::Invalid(_))
        ));
        assert!(WorkspaceLayout::new(req(16, u32::MAX - 15, u32::MAX, 0)).is_err());
    }
}
