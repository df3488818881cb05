//! The quant epilogue of a fused call ([`Quant`]) and its scale layouts.

use std::fmt;

use crate::dtype::ActDtype;
use crate::limits::{FP8_GROUP_SIZE, NVFP4_BLOCK};

/// Scale form of per-token-group FP8 quantisation (domain.md section 1): how the
/// scales are rounded and how they are stored. The one definition of these forms;
/// the IR, the reference, the rewrite and the runtime all use this enum.
///
/// The scale values (arfuse rounding contract v3, clause 4) are
/// `max(amax, 1e-10) / 448` for [`GroupScaleLayout::F32RowMajor`], and that value
/// floored at 1e-10 and rounded UP to a power of two for the two UE8M0 forms
/// (vLLM's `use_ue8m0=True`, DeepGEMM's scales).
///
/// The derived order (declaration order) is what the rewrite uses to break ties.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum GroupScaleLayout {
    /// `f32_row_major`: fp32 `[..., H / group_size]`, row-major, unrounded scales.
    F32RowMajor,
    /// `packed_ue8m0`: ue8m0 exponents, 4 per i32, logical
    /// `[..., ceil(H / group_size / 4)]` i32; stored column-major with a column
    /// stride of `round_up(T, 4)` words (DeepGEMM's TMA-aligned layout), so the
    /// tensor is `T + (ceil(G / 4) - 1) * round_up(T, 4)` words, as vLLM allocates it
    /// (`torch.empty_strided((T, C), (1, round_up(T, 4)))`); padding rows of every
    /// column but the last and unused bytes are zero.
    PackedUe8m0,
    /// `f32_row_major_ue8m0`: fp32 `[..., H / group_size]`, row-major, every scale a
    /// power of two (vLLM's `per_token_group_quant_fp8(..., use_ue8m0=True)` with
    /// row-major scales).
    F32RowMajorUe8m0,
}

impl GroupScaleLayout {
    /// Every form, in declaration order.
    pub const ALL: [GroupScaleLayout; 3] = [
        GroupScaleLayout::F32RowMajor,
        GroupScaleLayout::PackedUe8m0,
        GroupScaleLayout::F32RowMajorUe8m0,
    ];

    /// Whether the scales are powers of two (UE8M0 values).
    pub const fn power_of_two_scales(self) -> bool {
        matches!(
            self,
            GroupScaleLayout::PackedUe8m0 | GroupScaleLayout::F32RowMajorUe8m0
        )
    }

    /// Whether the scales are stored as fp32 `[..., G]` row-major (else packed i32).
    pub const fn f32_storage(self) -> bool {
        matches!(
            self,
            GroupScaleLayout::F32RowMajor | GroupScaleLayout::F32RowMajorUe8m0
        )
    }

    /// The JSON / text spelling (`f32_row_major`, `packed_ue8m0`, `f32_row_major_ue8m0`).
    pub const fn name(self) -> &'static str {
        match self {
            GroupScaleLayout::F32RowMajor => "f32_row_major",
            GroupScaleLayout::PackedUe8m0 => "packed_ue8m0",
            GroupScaleLayout::F32RowMajorUe8m0 => "f32_row_major_ue8m0",
        }
    }
}

/// Scale layout of NVFP4 quantisation (domain.md section 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum Nvfp4ScaleLayout {
    /// Row-major `[T, H/16]`. (Declared first: the derived order, linear before
    /// swizzled, is the rewrite's tie-break.)
    Linear,
    /// 512-byte tiles of [`crate::NVFP4_TILE_ROWS`] rows x [`crate::NVFP4_TILE_COLS`]
    /// scale columns; `round_up(T,128) * round_up(H/16,4)` bytes.
    #[cfg_attr(feature = "serde", serde(rename = "swizzled_128x4"))]
    Swizzled128x4,
}

impl Nvfp4ScaleLayout {
    /// The JSON / text spelling (`linear`, `swizzled_128x4`).
    pub const fn name(self) -> &'static str {
        match self {
            Nvfp4ScaleLayout::Linear => "linear",
            Nvfp4ScaleLayout::Swizzled128x4 => "swizzled_128x4",
        }
    }
}

/// The quant epilogue a fused kernel runs after the RMSNorm (domain.md section 1): the
/// kernels' `ARF_QUANT` ([`Quant::kernel_code`]). A per-token-group FP8 epilogue is
/// always of [`FP8_GROUP_SIZE`] elements, NVFP4 always of [`NVFP4_BLOCK`]-element
/// blocks: the graph's own group size is a fact of the IR (`FusedQuant`), which only
/// maps onto this type when it is the kernels' one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Quant {
    /// No quant output.
    None,
    /// Per-tensor FP8 e4m3, fp32 dequant scale given.
    Fp8Static,
    /// Dynamic per-token FP8, fp32 scales `[T, 1]`.
    Fp8PerToken,
    /// Per-token-group FP8 (groups of [`FP8_GROUP_SIZE`]) with scales in `layout`.
    Fp8Group(GroupScaleLayout),
    /// NVFP4 (SM100+), blocks of [`NVFP4_BLOCK`], scales in `layout`.
    Nvfp4(Nvfp4ScaleLayout),
}

impl Quant {
    /// Every quant epilogue including `None`, in the kernels' `ARF_QUANT` order
    /// (`kernel_code` 0 to 7).
    pub const ALL: [Quant; 8] = [
        Quant::None,
        Quant::Fp8Static,
        Quant::Fp8PerToken,
        Quant::Fp8Group(GroupScaleLayout::PackedUe8m0),
        Quant::Fp8Group(GroupScaleLayout::F32RowMajor),
        Quant::Nvfp4(Nvfp4ScaleLayout::Swizzled128x4),
        Quant::Nvfp4(Nvfp4ScaleLayout::Linear),
        Quant::Fp8Group(GroupScaleLayout::F32RowMajorUe8m0),
    ];

    /// The kernels' `ARF_QUANT` value (its name is [`Quant::define_name`]).
    pub const fn kernel_code(self) -> u32 {
        match self {
            Quant::None => 0,
            Quant::Fp8Static => 1,
            Quant::Fp8PerToken => 2,
            Quant::Fp8Group(GroupScaleLayout::PackedUe8m0) => 3,
            Quant::Fp8Group(GroupScaleLayout::F32RowMajor) => 4,
            Quant::Nvfp4(Nvfp4ScaleLayout::Swizzled128x4) => 5,
            Quant::Nvfp4(Nvfp4ScaleLayout::Linear) => 6,
            Quant::Fp8Group(GroupScaleLayout::F32RowMajorUe8m0) => 7,
        }
    }

    /// The name the kernel sources compare `ARF_QUANT` with (`ARF_Q_NONE`,
    /// `ARF_Q_FP8_GROUP_PACKED`, ...), defined by [`crate::kernel_defines`].
    pub const fn define_name(self) -> &'static str {
        match self {
            Quant::None => "ARF_Q_NONE",
            Quant::Fp8Static => "ARF_Q_FP8_STATIC",
            Quant::Fp8PerToken => "ARF_Q_FP8_TOKEN",
            Quant::Fp8Group(GroupScaleLayout::PackedUe8m0) => "ARF_Q_FP8_GROUP_PACKED",
            Quant::Fp8Group(GroupScaleLayout::F32RowMajor) => "ARF_Q_FP8_GROUP_F32",
            Quant::Nvfp4(Nvfp4ScaleLayout::Swizzled128x4) => "ARF_Q_NVFP4_SWIZZLED",
            Quant::Nvfp4(Nvfp4ScaleLayout::Linear) => "ARF_Q_NVFP4_LINEAR",
            Quant::Fp8Group(GroupScaleLayout::F32RowMajorUe8m0) => "ARF_Q_FP8_GROUP_F32_UE8M0",
        }
    }

    /// Short name used in kernel variant names (empty for `None`): `fp8s`, `fp8tok`,
    /// `fp8grp_ue8m0`, `fp8grp_f32`, `fp8grp_f32_ue8m0`, `nvfp4_swz`, `nvfp4_lin`.
    pub const fn name(self) -> &'static str {
        match self {
            Quant::None => "",
            Quant::Fp8Static => "fp8s",
            Quant::Fp8PerToken => "fp8tok",
            Quant::Fp8Group(GroupScaleLayout::PackedUe8m0) => "fp8grp_ue8m0",
            Quant::Fp8Group(GroupScaleLayout::F32RowMajor) => "fp8grp_f32",
            Quant::Fp8Group(GroupScaleLayout::F32RowMajorUe8m0) => "fp8grp_f32_ue8m0",
            Quant::Nvfp4(Nvfp4ScaleLayout::Swizzled128x4) => "nvfp4_swz",
            Quant::Nvfp4(Nvfp4ScaleLayout::Linear) => "nvfp4_lin",
        }
    }

    /// Whether this is a per-token-group FP8 form.
    pub const fn is_group(self) -> bool {
        matches!(self, Quant::Fp8Group(_))
    }

    /// Whether the quant needs SM100 or later (`cvt ... e2m1x2`): the NVFP4 forms.
    pub const fn needs_sm100(self) -> bool {
        matches!(self, Quant::Nvfp4(_))
    }

    /// Whether the dtype can feed this quant (NVFP4 is defined for 16-bit inputs).
    pub const fn supports(self, d: ActDtype) -> bool {
        !(self.needs_sm100() && matches!(d, ActDtype::F32))
    }

    /// The hidden size must be a multiple of this many elements: [`FP8_GROUP_SIZE`]
    /// for the group forms, [`NVFP4_BLOCK`] for NVFP4, 1 otherwise.
    pub const fn hidden_multiple(self) -> u64 {
        match self {
            Quant::Fp8Group(_) => FP8_GROUP_SIZE,
            Quant::Nvfp4(_) => NVFP4_BLOCK,
            _ => 1,
        }
    }

    /// Whether the quant reads a scale input (`scale_in`): the static FP8 dequant scale
    /// or the NVFP4 global scale.
    pub const fn takes_scale_input(self) -> bool {
        matches!(self, Quant::Fp8Static | Quant::Nvfp4(_))
    }

    /// Whether a scale output exists (every quant but `None` and static FP8).
    pub const fn has_scales(self) -> bool {
        !matches!(self, Quant::None | Quant::Fp8Static)
    }

    /// Why the kernels cannot run this epilogue on rows of `hidden` elements of `dtype`,
    /// or `None` when they can: NVFP4 with f32 activations, or a hidden size that is
    /// not a multiple of [`Quant::hidden_multiple`].
    pub fn unsupported(self, hidden: u64, dtype: ActDtype) -> Option<String> {
        if !self.supports(dtype) {
            return Some(format!(
                "{self} is not defined for {dtype} activations (it takes 16-bit ones)"
            ));
        }
        let m = self.hidden_multiple();
        (hidden % m != 0).then(|| {
            format!("{self} needs the hidden size ({hidden}) to be a multiple of {m} elements")
        })
    }
}

impl fmt::Display for Quant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Quant::None => f.write_str("no quant"),
            Quant::Fp8Static => f.write_str("static FP8"),
            Quant::Fp8PerToken => f.write_str("per-token FP8"),
            Quant::Fp8Group(l) => write!(
                f,
                "per-token-group FP8 (group {FP8_GROUP_SIZE}, {})",
                l.name()
            ),
            Quant::Nvfp4(Nvfp4ScaleLayout::Swizzled128x4) => f.write_str("NVFP4 (swizzled_128x4)"),
            Quant::Nvfp4(Nvfp4ScaleLayout::Linear) => f.write_str("NVFP4 (linear)"),
        }
    }
}
