//! Running the GPU check's cases ([`crate::check::Case`]) on the host device: the
//! buffers of one case, its parameters, and safe wrappers around the launches (sizes
//! are checked here, so the kernels only ever see memory the case owns).

use super::launch::{run_ranks, HostKernel, LaunchOptions, RankLaunch, RankTrace};
use super::memory::{HostWorkspace, Slots};
use crate::check::{self, Case, Inputs, Liveness, RankOutputs, FILL_BYTE};
use crate::device::{self, KernelParams, RankTensor};
use crate::error::{Error, Result};
use crate::variants::{self, Epilogue, KernelKind, Variant};

/// Default most CTAs per rank of a host launch (every rank uses the same grid, as the
/// protocols require; the kernels take any grid size). Small, because every CTA is an
/// OS thread and the CPU has few cores; at least 2 so that consecutive calls with
/// different T also change the grid.
pub const DEFAULT_HOST_CTAS: u32 = 4;

/// CTAs per rank of a fused call of `tokens` tokens: `min(T, 256, max_ctas)` (256 is
/// the GPU path's grid limit, `device::MAX_GRID_CTAS`).
pub fn fused_grid(tokens: u32, max_ctas: u32) -> u32 {
    tokens
        .min(crate::device::MAX_GRID_CTAS)
        .min(max_ctas.max(1))
        .max(1)
}

/// The host buffers of one case: W ranks' inputs and outputs ([`Slots`]: rank r's
/// slice at `ptr + r * rank_stride`, each followed by a guard gap), the RMSNorm
/// weight and the fp32 scalar (each with a gap too).
pub struct CaseIo {
    case: Case,
    x: Slots,
    residual: Slots,
    out: Slots,
    residual_out: Slots,
    quant: Slots,
    scale: Slots,
    gamma: Slots,
    scale_in: Slots,
}

impl CaseIo {
    /// Buffers for `case`, inputs uploaded from `inputs` (made by
    /// [`check::make_inputs`] for the same case), outputs filled with [`FILL_BYTE`].
    ///
    /// # Errors
    /// [`Error::Invalid`] for an invalid case or inputs of the wrong size; allocation
    /// errors.
    pub fn new(case: &Case, inputs: &Inputs) -> Result<CaseIo> {
        let b = case.output_bytes()?;
        let w = case.world;
        let gamma_bytes = u64::from(case.hidden) * check::gamma_dtype(case).element_bytes();
        let mut io = CaseIo {
            case: *case,
            x: Slots::new(b.out, w)?,
            residual: Slots::new(if case.epilogue.residual { b.out } else { 0 }, w)?,
            out: Slots::new(b.out, w)?,
            residual_out: Slots::new(b.residual_out, w)?,
            quant: Slots::new(b.quant, w)?,
            scale: Slots::new(b.scale, w)?,
            gamma: Slots::new(gamma_bytes, 1)?,
            scale_in: Slots::new(4, 1)?,
        };
        let act = io.x.size();
        let ranks = case.world as usize;
        if inputs.x.len() != ranks
            || inputs.x.iter().any(|v| v.len() != act)
            || (case.epilogue.residual
                && (inputs.residual.len() != ranks
                    || inputs.residual.iter().any(|v| v.len() != act)))
            || inputs.gamma.len() != io.gamma.size()
        {
            return Err(Error::Invalid(format!(
                "inputs do not match case {}",
                case.label()
            )));
        }
        for (r, x) in inputs.x.iter().enumerate() {
            io.x.slot_mut(r).copy_from_slice(x);
        }
        for (r, x) in inputs.residual.iter().enumerate() {
            io.residual.slot_mut(r).copy_from_slice(x);
        }
        io.gamma.slot_mut(0).copy_from_slice(&inputs.gamma);
        io.scale_in
            .slot_mut(0)
            .copy_from_slice(&inputs.scale_in.to_le_bytes());
        io.fill_outputs();
        Ok(io)
    }

    /// The case these buffers hold.
    pub fn case(&self) -> &Case {
        &self.case
    }

    /// Writes [`FILL_BYTE`] into every output (so unwritten and dead outputs show).
    pub fn fill_outputs(&mut self) {
        for buf in [
            &mut self.out,
            &mut self.residual_out,
            &mut self.quant,
            &mut self.scale,
        ] {
            buf.fill(FILL_BYTE);
        }
    }

    /// What the kernels wrote, per rank.
    ///
    /// # Errors
    /// [`Error::HostKernel`] when a kernel wrote past the end of a rank's slice of any
    /// tensor (its guard gap changed): the outputs are not returned then.
    pub fn outputs(&self) -> Result<Vec<RankOutputs>> {
        for (name, s) in [
            ("x", &self.x),
            ("residual_in", &self.residual),
            ("out", &self.out),
            ("residual_out", &self.residual_out),
            ("quant_out", &self.quant),
            ("scale_out", &self.scale),
            ("gamma", &self.gamma),
            ("scale_in", &self.scale_in),
        ] {
            if let Some(r) = s.overrun() {
                return Err(Error::HostKernel {
                    variant: self.case.variant().name(),
                    msg: format!(
                        "{}: a kernel wrote past the end of rank {r}'s {name} ({} bytes)",
                        self.case.label(),
                        s.size()
                    ),
                });
            }
        }
        Ok((0..self.case.world as usize)
            .map(|r| RankOutputs {
                out: self.out.slot(r).to_vec(),
                residual_out: self.residual_out.slot(r).to_vec(),
                quant: self.quant.slot(r).to_vec(),
                scale: self.scale.slot(r).to_vec(),
            })
            .collect())
    }

    fn tensor(s: &Slots, live: bool) -> RankTensor {
        if live && s.size() > 0 {
            RankTensor {
                ptr: s.addr(0),
                rank_stride: s.stride(),
            }
        } else {
            RankTensor::default()
        }
    }

    /// The tensor and scalar fields of the kernels' parameters, with the outputs of
    /// `live` live and the others null (workspace fields unset).
    pub fn params(&self, live: Liveness) -> KernelParams {
        let c = &self.case;
        KernelParams {
            x: Self::tensor(&self.x, true),
            residual_in: Self::tensor(&self.residual, c.epilogue.residual),
            residual_out: Self::tensor(&self.residual_out, live.residual_out),
            out: Self::tensor(&self.out, live.out),
            quant_out: Self::tensor(&self.quant, live.quant),
            scale_out: Self::tensor(&self.scale, live.scale),
            gamma: self.gamma.addr(0),
            scale_in: if c.epilogue.quant.takes_scale_input() {
                self.scale_in.addr(0)
            } else {
                0
            },
            eps: check::EPS as f32,
            weight_bias: c.weight_bias as f32,
            gamma_f32: i32::from(c.gamma_f32),
            norm_round_twice: i32::from(c.norm_round_twice),
            norm_f32_sum: i32::from(c.norm_f32_sum),
            timeout_ns: device::DEFAULT_TIMEOUT_NS,
            tokens: c.tokens as i32,
            hidden: c.hidden as i32,
            scale_rows: c.tokens as i32,
            ..KernelParams::default()
        }
    }
}

/// Checks that `kernel` is `want` and that the case fits `ws`.
fn check_fits(
    kernel: &HostKernel,
    want: &Variant,
    ws: Option<&HostWorkspace>,
    case: &Case,
) -> Result<()> {
    if kernel.variant() != want {
        return Err(Error::Invalid(format!(
            "case {} needs kernel {want}, got {}",
            case.label(),
            kernel.variant()
        )));
    }
    if let Some(ws) = ws {
        let r = &ws.workspace;
        if r.world_size != case.world || r.dtype != case.dtype || r.hidden < u64::from(case.hidden)
        {
            return Err(Error::Invalid(format!(
                "case {} does not match the workspace (W={}, {}, H<={})",
                case.label(),
                r.world_size,
                r.dtype,
                r.hidden
            )));
        }
        crate::device::check_fits(r, case.strategy, case.tokens, case.hidden)?;
    }
    Ok(())
}

/// One fused call of a case on a workspace, built by [`fused_launch`] (which checked
/// every size), for [`run_fused_sequence`]. Borrows the case's buffers, so they live
/// as long as the call.
#[derive(Debug, Clone, Copy)]
pub struct FusedCall<'a> {
    launch: RankLaunch<'a>,
    world: u32,
    workspace: u64,
    _io: std::marker::PhantomData<&'a CaseIo>,
}

impl FusedCall<'_> {
    /// The kernel parameters of rank 0 (`rank_base` is set per rank at launch).
    pub fn params(&self) -> &KernelParams {
        &self.launch.params
    }
    /// CTAs per rank.
    pub fn grid_x(&self) -> u32 {
        self.launch.grid_x
    }
}

/// One fused call of `io`'s case with `kernel` (the case's variant) on `ws`, the
/// outputs of `live` live, `fused_grid(T, max_ctas)` CTAs per rank, polling timeout
/// `timeout_ns`.
///
/// # Errors
/// [`Error::Invalid`] when the kernel is not the case's variant or the case does not
/// fit the workspace.
pub fn fused_launch<'a>(
    kernel: &'a HostKernel,
    ws: &HostWorkspace,
    io: &'a CaseIo,
    live: Liveness,
    max_ctas: u32,
    timeout_ns: u64,
) -> Result<FusedCall<'a>> {
    let case = io.case();
    check_fits(kernel, &case.variant(), Some(ws), case)?;
    let mut p = ws.params(io.params(live))?;
    p.timeout_ns = timeout_ns;
    Ok(FusedCall {
        launch: RankLaunch {
            kernel,
            params: p,
            grid_x: fused_grid(case.tokens, max_ctas),
            block: device::block_size(case.hidden, case.dtype)?,
        },
        world: case.world,
        workspace: ws.base(),
        _io: std::marker::PhantomData,
    })
}

/// Runs a sequence of fused calls with every rank as its own launch stream
/// ([`run_ranks`]): rank r launches call 0, 1, ... in order with random delays, so
/// ranks drift apart across calls. `ranks` ranks run (normally the world size; fewer
/// to model ranks that never arrive). The error word is read and cleared at the end.
/// Returns when each launch ran.
///
/// # Errors
/// [`Error::Invalid`] for calls built on another workspace or world size, or more
/// ranks than the world size; executor errors; [`Error::KernelTimeout`] when a kernel
/// gave up waiting.
pub fn run_fused_sequence(
    ws: &mut HostWorkspace,
    ranks: u32,
    calls: &[FusedCall<'_>],
    opts: &LaunchOptions,
) -> Result<RankTrace> {
    let world = ws.workspace.world_size;
    if ranks > world
        || calls
            .iter()
            .any(|c| c.workspace != ws.base() || c.world != world)
    {
        return Err(Error::Invalid(format!(
            "run_fused_sequence: {ranks} ranks, calls must be built on this workspace (W = {world})"
        )));
    }
    let launches: Vec<RankLaunch<'_>> = calls.iter().map(|c| c.launch).collect();
    // SAFETY: every launch was built by `fused_launch`, which checked the kernel and
    // the fit, and took every address from a CaseIo the call borrows (alive here) and
    // from this workspace (exclusively borrowed here).
    let r = unsafe { run_ranks(ranks, &launches, opts) };
    let e = ws.take_error();
    let trace = r?;
    ws.check_bounds()?;
    e?;
    Ok(trace)
}

/// Runs one fused case with `live` outputs: fills the outputs, launches every rank
/// separately, returns what they wrote.
///
/// # Errors
/// As [`fused_launch`] and [`run_fused_sequence`].
pub fn run_fused(
    kernel: &HostKernel,
    ws: &mut HostWorkspace,
    io: &mut CaseIo,
    live: Liveness,
    max_ctas: u32,
    opts: &LaunchOptions,
) -> Result<Vec<RankOutputs>> {
    io.fill_outputs();
    let call = fused_launch(kernel, ws, io, live, max_ctas, device::DEFAULT_TIMEOUT_NS)?;
    run_fused_sequence(ws, io.case().world, &[call], opts)?;
    io.outputs()
}

/// The local kernel the unfused path runs after the all-reduce for `epilogue` (none
/// for all-reduce only).
pub fn local_variant(case: &Case) -> Option<Variant> {
    (case.epilogue != Epilogue::AR_ONLY).then_some(Variant {
        kind: KernelKind::Local,
        dtype: case.dtype,
        epilogue: case.epilogue,
    })
}

/// The unfused path of a case, as `runner` launches it on a GPU: the virtual-rank
/// all-reduce (`ar`, [`variants::virtual_allreduce`]) writes every rank's reduced
/// tensor into `out`, then the local kernel (`local`, [`local_variant`]) reads it there
/// and runs the epilogue in place. Each is one launch of grid `(min(T, max_ctas), W)`
/// (virtual ranks in one launch, as on one GPU). Every output is live.
///
/// # Errors
/// [`Error::Invalid`] for kernels that are not the case's; executor errors.
pub fn run_unfused(
    ar: &HostKernel,
    local: Option<&HostKernel>,
    io: &mut CaseIo,
    max_ctas: u32,
    opts: &LaunchOptions,
) -> Result<Vec<RankOutputs>> {
    let case = *io.case();
    check_fits(
        ar,
        &variants::virtual_allreduce(case.world, case.dtype),
        None,
        &case,
    )?;
    let local_want = local_variant(&case);
    match (local, &local_want) {
        (Some(k), Some(v)) => check_fits(k, v, None, &case)?,
        (None, None) => {}
        _ => {
            return Err(Error::Invalid(format!(
                "case {}: the unfused path needs local kernel {:?}",
                case.label(),
                local_want.map(|v| v.name())
            )))
        }
    }
    io.fill_outputs();
    let live = Liveness::all(&case)?;
    let block = device::block_size(case.hidden, case.dtype)?;
    let gx = case.tokens.clamp(1, max_ctas.max(1));
    let mut p = io.params(live);
    // SAFETY: `io` owns buffers of the case's sizes for W ranks; the all-reduce reads
    // x and writes out, then the local kernel reads out (as x) and residual_in and
    // writes every live output; the kernels were checked to be the case's.
    unsafe {
        ar.launch(&p, gx, case.world, block, opts)?;
        if let Some(k) = local {
            p.x = p.out;
            k.launch(&p, gx, case.world, block, opts)?;
        }
    }
    io.outputs()
}
