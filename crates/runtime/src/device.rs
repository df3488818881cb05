//! The device abstraction: everything the runtime does on a device goes through
//! [`Device`], which has two implementations, [`crate::cuda::Gpu`] (a CUDA GPU, W
//! virtual ranks in one cooperative launch; the only code that links cudarc) and
//! [`crate::host::HostDevice`] (the same kernel sources compiled for the CPU, every rank
//! its own launch stream). [`crate::runner::Runner`] and everything above it are
//! generic over it.
//!
//! The model is a CUDA stream's: launches are enqueued in order and run later;
//! [`Device::sync`] waits for everything enqueued; errors a kernel reports through the
//! workspace's error word (a polling timeout) are read by [`Device::take_error`];
//! uploads and downloads are ordered after the launches enqueued before them. A
//! capture ([`Device::capture`]) records the launches its body enqueues instead of
//! running them; [`Device::replay`] enqueues the recorded launches again, in order,
//! with the same arguments (pointers included), as a CUDA graph does.
//!
//! Also here: the launch arguments both devices share ([`KernelParams`],
//! [`RankTensor`], [`FusedCall`]), the kernels' shape limits ([`block_size`]) and the
//! checks every launch makes before it is enqueued ([`fused_shape`], [`local_shape`],
//! [`virtual_allreduce_shape`]), so the two devices cannot accept different calls.

use crate::error::{Error, Result};
use crate::variants::{self, ActDtype, KernelKind, Strategy, Variant};
use crate::workspace::Backend;
use arfuse_policy::{ArfuseLayout, Workspace};

/// Default polling timeout of the kernels (globaltimer ns): 5 s. A correct protocol
/// never comes close; a broken one exits and reports instead of hanging.
pub const DEFAULT_TIMEOUT_NS: u64 = 5_000_000_000;
/// Most CTAs per rank of one fused launch (tokens are strided over them).
pub const MAX_GRID_CTAS: u32 = 256;

/// CTAs per rank of a launch of `tokens` tokens: `min(T, MAX_GRID_CTAS, co_resident)`,
/// `co_resident` being how many CTAs of the kernel one rank's device runs at once (a
/// fused launch needs every CTA of every rank running: its CTAs wait for each other's
/// data). The one formula of every device, so ranks on devices of one kind derive the
/// same width from the same T. The call protocol itself does not depend on the peers'
/// widths: a rank's CTAs push and poll the slots of their own tokens (two-shot owners
/// follow from T alone), clear their share of their own buffer and count their own
/// rank's arrivals.
pub fn grid_width(tokens: u32, co_resident: u32) -> u32 {
    tokens.min(MAX_GRID_CTAS).min(co_resident)
}
/// Most CTAs (grid x) of a local or virtual all-reduce launch (the driver's limit on
/// grid y and z is 65,535; the kernels stride tokens over grid x).
pub const MAX_LOCAL_CTAS: u32 = 65_535;

/// A device memory allocation (device address and size).
pub trait Allocation {
    /// Device address of the first byte.
    fn ptr(&self) -> u64;
    /// Size in bytes.
    fn bytes(&self) -> u64;
}

/// A device the runtime runs kernels on. See the module documentation for the
/// ordering model. Every method returns an error instead of panicking; none of them
/// allocates, compiles or creates anything while [`Device::is_capturing`] is true
/// (they return [`Error::Capturing`]), except the launches, which are recorded.
pub trait Device {
    /// A created workspace: the plan's [`Workspace`] for its W ranks, initialised
    /// (Lamport buffers to the -0.0 sentinel, the state block zero), and the error word.
    type Workspace;
    /// A captured sequence of launches.
    type Graph;
    /// A memory allocation for the tensors of a call.
    type Buffer: Allocation;

    /// Whether a capture is in progress.
    ///
    /// # Errors
    /// Device errors.
    fn is_capturing(&self) -> Result<bool>;

    /// Creates `request` for its W ranks, mapped for `backend`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] when this device cannot provide `backend` or the memory;
    /// [`Error::Invalid`] for a workspace that is not arfuse's layout; [`Error::Capturing`].
    fn create_workspace(
        &mut self,
        backend: Backend,
        request: &Workspace,
    ) -> Result<Self::Workspace>;

    /// Compiles (as needed) and loads every variant of `variants`, so that no later
    /// launch compiles anything.
    ///
    /// # Errors
    /// Compiler errors; [`Error::Capturing`].
    fn load(&mut self, variants: &[Variant]) -> Result<()>;

    /// Enqueues a fused call on `ws` (every rank of the workspace's world size).
    ///
    /// # Errors
    /// As [`fused_shape`] (which includes [`check_tensor_uses`]); [`Error::Invalid`]
    /// when the variant was not loaded before a capture or a tensor lies outside the
    /// device's allocations (the GPU asks the driver, the host device its regions);
    /// launch errors.
    fn launch_fused(&mut self, ws: &Self::Workspace, call: &FusedCall) -> Result<()>;

    /// Enqueues the local kernel of the unfused path (residual add, RMSNorm, quant on an
    /// all-reduced tensor) for every rank of `call.ranks`.
    ///
    /// # Errors
    /// As [`local_shape`]; as [`Device::launch_fused`].
    fn launch_local(&mut self, call: &FusedCall) -> Result<()>;

    /// Enqueues the virtual-rank all-reduce of the unfused path (`call.variant` is
    /// [`variants::virtual_allreduce`]): for every rank r, `params.out[r] =
    /// round_T(sum over q in rank order of params.x[q])` (contract clause 1). Ranks
    /// meet in it: it starts when every rank has finished what it was given before (a
    /// collective, as NCCL's all-reduce on real ranks).
    ///
    /// # Errors
    /// As [`virtual_allreduce_shape`]; as [`Device::launch_fused`].
    fn launch_virtual_allreduce(&mut self, call: &FusedCall) -> Result<()>;

    /// Records the launches `body` enqueues (they do not run) into a graph. Workspace
    /// creation, loading and allocation are refused while `body` runs.
    ///
    /// # Errors
    /// What `body` returns; device errors.
    fn capture(&mut self, body: &mut dyn FnMut(&mut Self) -> Result<()>) -> Result<Self::Graph>;

    /// Enqueues the launches of `graph` again, in order, with their recorded arguments.
    ///
    /// # Errors
    /// Device errors.
    fn replay(&mut self, graph: &Self::Graph) -> Result<()>;

    /// Waits until everything enqueued has run.
    ///
    /// # Errors
    /// The first launch failure (executor or driver error) since the last sync; the
    /// launches after it may not have run.
    fn sync(&mut self) -> Result<()>;

    /// Waits for everything enqueued, then reads and clears the error word of `ws`.
    ///
    /// # Errors
    /// [`Error::KernelTimeout`] with the word when a kernel gave up waiting for a peer;
    /// as [`Device::sync`].
    fn take_error(&mut self, ws: &Self::Workspace) -> Result<()>;

    /// Waits for everything enqueued, then puts `ws` back in the state it was created
    /// in: every rank's Lamport buffers hold the -0.0 sentinel again, the call state
    /// (call counter, arrival counter, bytes used per buffer) is zero and the error word
    /// is clear. After a kernel gave up waiting for a peer the ranks disagree on the
    /// call count and a buffer may hold a partial call's data, so the workspace must be
    /// reset before it is used again ([`crate::runner::Runner::sync`] does it).
    ///
    /// # Errors
    /// [`Error::Capturing`] while a capture records; as [`Device::sync`].
    fn reset_workspace(&mut self, ws: &Self::Workspace) -> Result<()>;

    /// Allocates `bytes` of zeroed device memory.
    ///
    /// # Errors
    /// [`Error::Capturing`]; [`Error::Unsupported`] when the memory is not there.
    fn alloc(&mut self, bytes: u64) -> Result<Self::Buffer>;

    /// Copies `src` into `dst` at `offset`, after everything enqueued before.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the range overruns `dst`; device errors.
    fn upload(&mut self, dst: &Self::Buffer, offset: u64, src: &[u8]) -> Result<()>;

    /// Copies `dst.len()` bytes of `src` from `offset`, after everything enqueued before.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the range overruns `src`; device errors.
    fn download(&mut self, src: &Self::Buffer, offset: u64, dst: &mut [u8]) -> Result<()>;

    /// Sets `bytes` bytes of `buf` from `offset` to `value`, after everything enqueued
    /// before.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the range overruns `buf`; device errors.
    fn fill(&mut self, buf: &Self::Buffer, offset: u64, bytes: u64, value: u8) -> Result<()>;
}

/// One tensor per rank: rank r at `ptr + r * rank_stride` (bytes). Mirrors `ArfTensor`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankTensor {
    /// Address of rank 0's tensor (0 = dead output / unused input).
    pub ptr: u64,
    /// Bytes between consecutive ranks' tensors.
    pub rank_stride: u64,
}

/// Kernel parameters, layout-identical to `ArfParams` in `kernels/arfuse_common.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct KernelParams {
    /// Workspace base address of each rank.
    pub peer: [u64; arfuse_abi::MAX_RANKS as usize],
    /// All-reduce input (local kernel: input).
    pub x: RankTensor,
    /// Residual input.
    pub residual_in: RankTensor,
    /// Residual output (0 = dead).
    pub residual_out: RankTensor,
    /// Norm output, or the all-reduce output without norm (0 = dead).
    pub out: RankTensor,
    /// Quant output (0 = dead).
    pub quant_out: RankTensor,
    /// Scale output (0 = dead).
    pub scale_out: RankTensor,
    /// RMSNorm weight `[H]`.
    pub gamma: u64,
    /// fp32 scalar: static fp8 dequant scale or NVFP4 global scale.
    pub scale_in: u64,
    /// Workspace offsets ([`ArfuseLayout`]): the state block.
    pub off_state: u64,
    /// The first Lamport buffer.
    pub off_lamport: u64,
    /// Bytes of one Lamport buffer.
    pub lamport_stride: u64,
    /// u32 error word.
    pub err: u64,
    /// Polling timeout, ns.
    pub timeout_ns: u64,
    /// Tokens T.
    pub tokens: i32,
    /// Hidden size H.
    pub hidden: i32,
    /// Rank of `blockIdx.y == 0`.
    pub rank_base: i32,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// 0 or 1 (Gemma-style weight offset).
    pub weight_bias: f32,
    /// 1 when `gamma` is f32 (the Gemma form `1 + w.float()` with 16-bit activations),
    /// 0 when it has the activation dtype. `ArfParams::gamma_f32`.
    pub gamma_f32: i32,
    /// 1 when the RMSNorm rounds `h * r` to the activation dtype before the weight
    /// multiply (`NormRounding::Twice`, the Llama order), 0 for one rounding.
    /// `ArfParams::norm_round_twice`.
    pub norm_round_twice: i32,
    /// 1 when the RMSNorm normalises the unrounded f32 sum of the all-reduce output and
    /// the residual (`NormInput::F32Sum`), 0 for the rounded residual.
    /// `ArfParams::norm_f32_sum`.
    pub norm_f32_sum: i32,
    /// The caller's tag of this call (its fused site; the low byte counts), written into
    /// the call header every rank checks (`arfuse_abi::protocol`): ranks that run
    /// different sites in the same call stop with `ERR_CALL_MISMATCH`.
    pub call_tag: u32,
    /// The row of the scale layout that this call's token 0 is: `scale_out` holds the
    /// scales of [`KernelParams::scale_rows`] tokens, and a T split into several calls
    /// writes one tensor (packed UE8M0 and swizzled NVFP4 scales depend on the whole
    /// T). `ArfParams::scale_row0`; 0 for a call that is the whole tensor.
    pub scale_row0: i32,
    /// Tokens of the scale layout `scale_out` points at (at least `scale_row0 + T`);
    /// 0 means the call's own T ([`KernelParams::for_call`] fills it in).
    /// `ArfParams::scale_rows`.
    pub scale_rows: i32,
}

const _: () = assert!(std::mem::size_of::<KernelParams>() == 328);

impl KernelParams {
    /// Fills the workspace fields from a layout and the base of rank 0's slice
    /// (virtual ranks: rank r of `world` at `base + r * bytes_per_rank`).
    ///
    /// # Errors
    /// [`Error::Invalid`] for more than [`arfuse_abi::MAX_RANKS`] ranks; [`Error::Overflow`].
    pub fn with_virtual_workspace(
        mut self,
        layout: &ArfuseLayout,
        world: u32,
        base: u64,
        err: u64,
    ) -> Result<Self> {
        if world as usize > self.peer.len() {
            return Err(Error::Invalid(format!(
                "{world} ranks; the kernels take at most {}",
                arfuse_abi::MAX_RANKS
            )));
        }
        for r in 0..world as usize {
            self.peer[r] = (r as u64)
                .checked_mul(layout.bytes_per_rank)
                .and_then(|o| o.checked_add(base))
                .ok_or(Error::Overflow("peer address"))?;
        }
        self.off_state = layout.state_offset;
        self.off_lamport = layout.lamport_offset;
        self.lamport_stride = layout.lamport_buffer_bytes;
        self.err = err;
        Ok(self)
    }

    /// These parameters with the call's shape: `tokens`, `hidden`, `rank_base` 0, the
    /// default timeout when none is set, and a scale layout of the call's own T when
    /// `scale_rows` is 0.
    ///
    /// # Errors
    /// [`Error::Overflow`] for T or H above `i32::MAX`; [`Error::Invalid`] for a scale
    /// layout that does not hold this call's rows (`scale_row0 + T > scale_rows`, or a
    /// negative row).
    pub fn for_call(mut self, call: &FusedCall) -> Result<Self> {
        self.tokens = i32::try_from(call.tokens).map_err(|_| Error::Overflow("T"))?;
        self.hidden = i32::try_from(call.hidden).map_err(|_| Error::Overflow("H"))?;
        self.rank_base = 0;
        if self.timeout_ns == 0 {
            self.timeout_ns = DEFAULT_TIMEOUT_NS;
        }
        if self.scale_rows == 0 {
            self.scale_rows = self.tokens;
        }
        let end = i64::from(self.scale_row0) + i64::from(self.tokens);
        if self.scale_row0 < 0 || end > i64::from(self.scale_rows) {
            return Err(Error::Invalid(format!(
                "the call's scale rows {}..{end} lie outside a layout of {} tokens",
                self.scale_row0, self.scale_rows
            )));
        }
        Ok(self)
    }
}

/// One fused, local or virtual all-reduce call: the variant, shapes and per-rank
/// tensors.
#[derive(Debug, Clone, Copy)]
pub struct FusedCall {
    /// Kernel variant.
    pub variant: Variant,
    /// Tokens T.
    pub tokens: u32,
    /// Hidden size H of this call (elements; at most the workspace's).
    pub hidden: u32,
    /// Ranks in this launch (W).
    pub ranks: u32,
    /// Tensors and scalars; the shape and workspace fields are filled by the device.
    pub params: KernelParams,
}

/// Threads per block for a token of `hidden` elements of `dtype`: the policy's
/// [`arfuse_policy::arfuse_block_threads`] (16-byte vectors, at most four per thread,
/// whole warps, at least 128 threads), the plan-time limit the planner already
/// checked.
///
/// # Errors
/// [`Error::Unsupported`] with the policy's reason when the kernels cannot run the row.
pub fn block_size(hidden: u32, dtype: ActDtype) -> Result<u32> {
    arfuse_policy::arfuse_block_threads(u64::from(hidden), dtype)
        .map_err(|e| Error::Unsupported(e.to_string()))
}

/// The arfuse layout of a workspace the runtime can allocate.
///
/// # Errors
/// [`Error::Invalid`] for FlashInfer's kernels (arfuse's runtime runs its own) or a
/// workspace with problems of its own.
pub fn arfuse_layout(workspace: &Workspace) -> Result<ArfuseLayout> {
    let problems = workspace.problems();
    if !problems.is_empty() {
        return Err(Error::Invalid(format!(
            "workspace: {}",
            problems.join("; ")
        )));
    }
    workspace.arfuse_layout().ok_or_else(|| {
        Error::Invalid(format!(
            "the workspace is laid out for {}'s kernels; arfuse-runtime runs plans made for \
             kernels = \"arfuse\"",
            workspace.kernels
        ))
    })
}

/// Whether a fused call of `tokens` tokens at `hidden` with `strategy` may run in
/// `workspace`: the policy's capacity rule ([`Workspace::misfit`]), the one the
/// planner proved the plan with.
///
/// # Errors
/// [`Error::Invalid`] naming the required and available bytes (or T < W for FlashInfer's
/// two-shot, which this runtime never runs).
pub fn check_fits(
    workspace: &Workspace,
    strategy: Strategy,
    tokens: u32,
    hidden: u32,
) -> Result<()> {
    let misfit = workspace
        .misfit(strategy, u64::from(tokens), u64::from(hidden))
        .map_err(|e| Error::Invalid(e.to_string()))?;
    match misfit {
        None => Ok(()),
        Some(arfuse_policy::Misfit::BelowWorldSize { world_size }) => Err(Error::Invalid(format!(
            "{} at T = {tokens} needs T >= W = {world_size}",
            strategy
        ))),
        Some(arfuse_policy::Misfit::TooLarge {
            required_bytes,
            available_bytes,
        }) => Err(Error::Invalid(format!(
            "{} at T = {tokens} needs {required_bytes} bytes of one Lamport buffer; it has \
             {available_bytes}",
            strategy
        ))),
    }
}

/// The checks of a fused launch on `workspace`, shared by every device: the variant is
/// fused, for the workspace's world size and dtype, and the call fits the workspace
/// ([`check_fits`]). Returns the strategy, the world size and the block size.
///
/// # Errors
/// [`Error::Invalid`] for a non-fused variant, a world size or dtype other than the
/// workspace's, T = 0 or a call the workspace cannot hold; [`Error::Unsupported`]
/// for a hidden size the kernels cannot run.
pub fn fused_shape(workspace: &Workspace, call: &FusedCall) -> Result<(Strategy, u32, u32)> {
    let KernelKind::Fused { strategy, world } = call.variant.kind else {
        return Err(Error::Invalid(format!(
            "a fused launch needs a fused variant, not {}",
            call.variant
        )));
    };
    if world != workspace.world_size || call.variant.dtype != workspace.dtype {
        return Err(Error::Invalid(format!(
            "variant {} differs from the workspace (W = {}, {})",
            call.variant, workspace.world_size, workspace.dtype
        )));
    }
    if call.tokens == 0 || call.ranks != world {
        return Err(Error::Invalid(format!(
            "fused call of T = {} on {} ranks (W = {world})",
            call.tokens, call.ranks
        )));
    }
    check_fits(workspace, strategy, call.tokens, call.hidden)?;
    check_tensor_uses(call)?;
    Ok((
        strategy,
        world,
        block_size(call.hidden, call.variant.dtype)?,
    ))
}

/// [`fused_shape`] for one real rank's launch: the same checks of the variant, the
/// world size and the fit, with the tensors checked as one rank's (a real rank passes
/// its own tensors with `rank_stride` 0; its peers' are in their processes).
///
/// # Errors
/// As [`fused_shape`].
pub fn fused_shape_of_rank(
    workspace: &Workspace,
    call: &FusedCall,
) -> Result<(Strategy, u32, u32)> {
    let shape = fused_shape(
        workspace,
        &FusedCall {
            params: KernelParams {
                x: RankTensor::default(),
                residual_in: RankTensor::default(),
                residual_out: RankTensor::default(),
                out: RankTensor::default(),
                quant_out: RankTensor::default(),
                scale_out: RankTensor::default(),
                gamma: 0,
                scale_in: 0,
                ..call.params
            },
            ..*call
        },
    )?;
    check_tensor_uses(&FusedCall { ranks: 1, ..*call })?;
    Ok(shape)
}

/// The checks of a local launch: a local variant, T >= 1, ranks in 1..=16. Returns the
/// block size.
///
/// # Errors
/// [`Error::Invalid`]; [`Error::Unsupported`] for a hidden size the kernels cannot run.
pub fn local_shape(call: &FusedCall) -> Result<u32> {
    if call.variant.kind != KernelKind::Local {
        return Err(Error::Invalid(format!(
            "a local launch needs a local variant, not {}",
            call.variant
        )));
    }
    if call.tokens == 0 || !(1..=arfuse_abi::MAX_RANKS).contains(&call.ranks) {
        return Err(Error::Invalid(format!(
            "local call of T = {} on {} ranks",
            call.tokens, call.ranks
        )));
    }
    check_tensor_uses(call)?;
    block_size(call.hidden, call.variant.dtype)
}

/// The checks of a virtual all-reduce launch: the variant is
/// [`variants::virtual_allreduce`] of `call.ranks` ranks, W in {2, 4, 8, 16}, T >= 1.
/// Returns the block size.
///
/// # Errors
/// [`Error::Invalid`]; [`Error::Unsupported`] for a hidden size the kernels cannot run.
pub fn virtual_allreduce_shape(call: &FusedCall) -> Result<u32> {
    let world = call.ranks;
    if !variants::WORLD_SIZES.contains(&world)
        || call.tokens == 0
        || call.variant != variants::virtual_allreduce(world, call.variant.dtype)
    {
        return Err(Error::Invalid(format!(
            "virtual all-reduce: {} with W = {world}, T = {}",
            call.variant, call.tokens
        )));
    }
    check_tensor_uses(call)?;
    block_size(call.hidden, call.variant.dtype)
}

/// A tensor a call's kernel reads or writes, with what the kernel needs of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorUse {
    /// The [`KernelParams`] field (`x`, `residual_in`, ..., `gamma`, `scale_in`).
    pub name: &'static str,
    /// Rank 0's address and the bytes between ranks (0 for the shared `gamma` and
    /// `scale_in`).
    pub tensor: RankTensor,
    /// Bytes of one rank's tensor the kernel may touch for the call's T and H: the
    /// contiguous `[T, H]` rows, the quant data, the scales of the whole layout
    /// (`scale_rows` tokens) with their padding ([`crate::check::quant_bytes_of`]), H
    /// weights, one f32 scale.
    pub bytes: u64,
    /// Alignment (bytes) of the kernel's accesses: 16 for activations and the weight
    /// (16-byte vectors), one vector's quant bytes for the quant data (16 / element
    /// size FP8 bytes, half that in NVFP4), 4 for f32 / packed scales and `scale_in`,
    /// 1 for NVFP4's byte scales.
    pub align: u64,
    /// Whether the kernel writes it (ranks' copies must then not overlap).
    pub written: bool,
}

/// The tensors the kernel of `call` touches (null ones and outputs the epilogue does
/// not produce left out), with their sizes and alignments.
///
/// # Errors
/// [`Error::Overflow`] on absurd sizes; as [`crate::check::quant_bytes_of`].
pub fn tensor_uses(call: &FusedCall) -> Result<Vec<TensorUse>> {
    use crate::variants::Quant;
    let p = &call.params;
    let e = call.variant.dtype.element_bytes();
    let act = u64::from(call.tokens)
        .checked_mul(u64::from(call.hidden))
        .and_then(|n| n.checked_mul(e))
        .ok_or(Error::Overflow("activation bytes"))?;
    let quant = call.variant.epilogue.quant;
    let (quant_bytes, _) = crate::check::quant_bytes_of(quant, call.tokens, call.hidden)?;
    // The scales are of the whole layout the call writes into (`scale_rows`; 0: T).
    let scale_rows = u32::try_from(p.scale_rows)
        .ok()
        .filter(|&r| r > 0)
        .unwrap_or(call.tokens);
    let (_, scale_bytes) = crate::check::quant_bytes_of(quant, scale_rows, call.hidden)?;
    let vector_elems = arfuse_abi::VECTOR_BYTES / e;
    let (quant_align, scale_align) = match quant {
        Quant::Nvfp4(_) => (vector_elems / 2, 1),
        _ => (vector_elems, 4),
    };
    let gamma_bytes = u64::from(call.hidden) * if p.gamma_f32 != 0 { 4 } else { e };
    let shared = |ptr: u64| RankTensor {
        ptr,
        rank_stride: 0,
    };
    let vec = arfuse_abi::VECTOR_BYTES;
    let all = [
        ("x", p.x, act, vec, false),
        ("residual_in", p.residual_in, act, vec, false),
        ("residual_out", p.residual_out, act, vec, true),
        ("out", p.out, act, vec, true),
        ("quant_out", p.quant_out, quant_bytes, quant_align, true),
        ("scale_out", p.scale_out, scale_bytes, scale_align, true),
        ("gamma", shared(p.gamma), gamma_bytes, vec, false),
        ("scale_in", shared(p.scale_in), 4, 4, false),
    ];
    Ok(all
        .into_iter()
        .filter(|&(_, t, bytes, _, _)| t.ptr != 0 && bytes != 0)
        .map(|(name, tensor, bytes, align, written)| TensorUse {
            name,
            tensor,
            bytes,
            align,
            written,
        })
        .collect())
}

/// The host-side checks of a call's tensors before any launch: every address and rank
/// stride a multiple of the kernel's access size ([`TensorUse::align`]; a misaligned
/// vector access faults the GPU), and the ranks' copies of every output at least its
/// bytes apart (closer, two ranks would write the same bytes). Whether the memory is
/// there is the device's check (it knows its allocations).
///
/// # Errors
/// [`Error::Invalid`] naming the tensor; as [`tensor_uses`].
pub fn check_tensor_uses(call: &FusedCall) -> Result<Vec<TensorUse>> {
    let uses = tensor_uses(call)?;
    for u in &uses {
        let TensorUse {
            name,
            tensor,
            align,
            ..
        } = *u;
        if tensor.ptr % align != 0 {
            return Err(Error::Invalid(format!(
                "tensor {name}: address {:#x} is not a multiple of {align} bytes (the kernel's access size)",
                tensor.ptr
            )));
        }
        if call.ranks > 1 && tensor.rank_stride % align != 0 {
            return Err(Error::Invalid(format!(
                "tensor {name}: rank stride {} bytes is not a multiple of {align}",
                tensor.rank_stride
            )));
        }
        if u.written && call.ranks > 1 && tensor.rank_stride < u.bytes {
            return Err(Error::Invalid(format!(
                "tensor {name}: ranks {} bytes apart overlap its {} bytes per rank (T = {}, H = {})",
                tensor.rank_stride, u.bytes, call.tokens, call.hidden
            )));
        }
    }
    Ok(uses)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_are_the_policys() {
        assert_eq!(block_size(6144, ActDtype::Bf16).unwrap(), 768);
        assert!(matches!(
            block_size(65536, ActDtype::Bf16),
            Err(Error::Unsupported(_))
        ));
        assert!(matches!(
            block_size(100, ActDtype::Bf16),
            Err(Error::Unsupported(_))
        ));
    }

    #[test]
    fn params_layout_and_virtual_peers() {
        let ws = Workspace::arfuse(
            arfuse_policy::Backend::Trtllm,
            4,
            4096,
            arfuse_policy::ActDtype::Bf16,
            Some(16),
            16 * 4 * 4096 * 2,
        )
        .unwrap();
        let layout = arfuse_layout(&ws).unwrap();
        let p = KernelParams::default()
            .with_virtual_workspace(&layout, 4, 0x1000_0000, 0x2000)
            .unwrap();
        assert_eq!(p.peer[3], 0x1000_0000 + 3 * (256 + 3 * 16 * 4 * 4096 * 2));
        assert_eq!(p.peer[4], 0);
        assert_eq!((p.off_state, p.off_lamport), (0, 256));
        assert_eq!(p.lamport_stride, 16 * 4 * 4096 * 2);
        assert_eq!(std::mem::offset_of!(KernelParams, x), 128);
        assert_eq!(std::mem::offset_of!(KernelParams, gamma), 224);
        assert_eq!(std::mem::offset_of!(KernelParams, tokens), 280);
        assert_eq!(std::mem::offset_of!(KernelParams, eps), 292);
        // The capacity rule is the policy's: one-shot T=16 fits, 17 does not; two-shot
        // runs T < W (T=3) and fits up to 2 * ceil(T/4) * 4 * 8192 <= 524,288: T = 32.
        check_fits(&ws, Strategy::OneShot, 16, 4096).unwrap();
        let e = check_fits(&ws, Strategy::OneShot, 17, 4096).unwrap_err();
        assert!(e.to_string().contains("557056 bytes"), "{e}");
        check_fits(&ws, Strategy::TwoShot, 3, 4096).unwrap();
        check_fits(&ws, Strategy::TwoShot, 32, 4096).unwrap();
        let e = check_fits(&ws, Strategy::TwoShot, 33, 4096).unwrap_err();
        assert!(e.to_string().contains("589824 bytes"), "{e}");
        // FlashInfer's layouts are not this runtime's.
        let fi = Workspace::flashinfer_mnnvl(4, 4096, arfuse_policy::ActDtype::Bf16, 16).unwrap();
        assert!(arfuse_layout(&fi)
            .unwrap_err()
            .to_string()
            .contains("flashinfer"));
    }

    #[test]
    fn tensor_checks_name_the_tensor() {
        use crate::variants::{Epilogue, Quant};
        let t = |ptr, rank_stride| RankTensor { ptr, rank_stride };
        // W = 2, T = 4, H = 256 bf16: 2,048 bytes per rank and activation; per-token FP8
        // scales are 16 bytes.
        let act = 4 * 256 * 2;
        let call = |quant, params| FusedCall {
            variant: Variant {
                kind: KernelKind::Local,
                dtype: ActDtype::Bf16,
                epilogue: Epilogue {
                    residual: true,
                    norm: true,
                    quant,
                },
            },
            tokens: 4,
            hidden: 256,
            ranks: 2,
            params,
        };
        let good = KernelParams {
            x: t(0x10000, act),
            residual_in: t(0x20000, act),
            residual_out: t(0x30000, act),
            out: t(0x40000, act),
            quant_out: t(0x50000, 1024),
            scale_out: t(0x60000, 16),
            gamma: 0x70000,
            scale_in: 0x70800,
            ..KernelParams::default()
        };
        let uses = check_tensor_uses(&call(Quant::Fp8PerToken, good)).unwrap();
        let sizes: Vec<(&str, u64, u64)> =
            uses.iter().map(|u| (u.name, u.bytes, u.align)).collect();
        assert_eq!(
            sizes,
            [
                ("x", act, 16),
                ("residual_in", act, 16),
                ("residual_out", act, 16),
                ("out", act, 16),
                ("quant_out", 1024, 8),
                ("scale_out", 16, 4),
                ("gamma", 512, 16),
                ("scale_in", 4, 4),
            ]
        );
        let bad =
            |p: KernelParams, quant| check_tensor_uses(&call(quant, p)).unwrap_err().to_string();
        let e = bad(
            KernelParams {
                x: t(0x10008, act),
                ..good
            },
            Quant::Fp8PerToken,
        );
        assert!(
            e.contains("tensor x: address 0x10008 is not a multiple of 16"),
            "{e}"
        );
        let e = bad(
            KernelParams {
                gamma: 0x70004,
                ..good
            },
            Quant::Fp8PerToken,
        );
        assert!(e.contains("tensor gamma:"), "{e}");
        let e = bad(
            KernelParams {
                out: t(0x40000, act + 8),
                ..good
            },
            Quant::Fp8PerToken,
        );
        assert!(e.contains("tensor out: rank stride 2056 bytes"), "{e}");
        let e = bad(
            KernelParams {
                scale_out: t(0x60000, 12),
                ..good
            },
            Quant::Fp8PerToken,
        );
        assert!(
            e.contains("tensor scale_out: ranks 12 bytes apart overlap its 16 bytes"),
            "{e}"
        );
        let e = bad(
            KernelParams {
                quant_out: t(0x50004, 1024),
                ..good
            },
            Quant::Fp8PerToken,
        );
        assert!(
            e.contains("tensor quant_out: address 0x50004 is not a multiple of 8"),
            "{e}"
        );
        // NVFP4: 4-byte data stores, byte scales (swizzled: 128 padded rows x 16 columns).
        let nv = KernelParams {
            quant_out: t(0x50004, 512),
            scale_out: t(0x60001, 128 * 16),
            ..good
        };
        let uses = check_tensor_uses(&call(
            Quant::Nvfp4(arfuse_abi::Nvfp4ScaleLayout::Swizzled128x4),
            nv,
        ))
        .unwrap();
        assert_eq!(
            uses.iter()
                .find(|u| u.name == "scale_out")
                .map(|u| (u.bytes, u.align)),
            Some((2048, 1))
        );
        // Dead outputs are not checked; an input read by every rank may be shared.
        let dead = KernelParams {
            out: t(0, 0),
            x: t(0x10000, 0),
            ..good
        };
        let uses = check_tensor_uses(&call(Quant::Fp8PerToken, dead)).unwrap();
        assert!(uses.iter().all(|u| u.name != "out"));
    }

    #[test]
    fn every_device_refuses_the_same_calls() {
        let ws = crate::check::workspace_for(4, ActDtype::Bf16, 256, 16).unwrap();
        let fused = |strategy, world, tokens| FusedCall {
            variant: Variant {
                kind: KernelKind::Fused { strategy, world },
                dtype: ActDtype::Bf16,
                epilogue: variants::Epilogue::RES_NORM,
            },
            tokens,
            hidden: 256,
            ranks: world,
            params: KernelParams::default(),
        };
        assert_eq!(
            fused_shape(&ws, &fused(Strategy::TwoShot, 4, 16)).unwrap(),
            (Strategy::TwoShot, 4, 128)
        );
        for (call, want) in [
            (
                fused(Strategy::OneShot, 8, 16),
                "differs from the workspace",
            ),
            (fused(Strategy::OneShot, 4, 0), "T = 0"),
            (
                fused(Strategy::OneShot, 4, 17),
                "bytes of one Lamport buffer",
            ),
        ] {
            let e = fused_shape(&ws, &call).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let local = Variant {
            kind: KernelKind::Local,
            ..fused(Strategy::OneShot, 4, 1).variant
        };
        let mut c = fused(Strategy::OneShot, 4, 3);
        assert!(local_shape(&c).is_err() && virtual_allreduce_shape(&c).is_err());
        c.variant = local;
        assert_eq!(local_shape(&c).unwrap(), 128);
        c.variant = variants::virtual_allreduce(4, ActDtype::Bf16);
        assert_eq!(virtual_allreduce_shape(&c).unwrap(), 128);
        c.ranks = 2;
        assert!(virtual_allreduce_shape(&c).is_err());
    }
}
