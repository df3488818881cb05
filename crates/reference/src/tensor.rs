//! Concrete tensors of the reference evaluator.
//!
//! A [`Tensor`] holds its values in logical row-major order with a concrete
//! shape (symbols already bound). Floating and quantised element types are
//! held as `f32` values (every bf16, f16, f32, fp8 e4m3 and ue8m0 value is
//! exactly an f32); packed fp4 (`fp4_e2m1x2`) and `u8` elements are held as
//! their byte value (0..=255) in an `f32`; `i32` and `i64` as `i64`.
//!
//! Scale tensors of quant ops keep their LOGICAL shape (as typed by the IR);
//! [`Tensor::storage`] records the physical layout the kernels write, and
//! [`Tensor::physical_bytes`] produces that memory image (padding and
//! swizzling included, domain.md section 1).

use crate::error::{ReferenceError, Result};
use crate::numerics::fp8::e4m3_satfinite;
use crate::numerics::quant::{
    nvfp4_scale_bytes, nvfp4_scale_offset, packed_group_scale_words, Nvfp4ScaleLayout,
};
use crate::numerics::FloatFormat;
use arfuse_ir::DType;

/// Element storage of a [`Tensor`].
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// bf16, f16, f32, fp8_e4m3, ue8m0 values; fp4_e2m1x2 and u8 byte values.
    F32(Vec<f32>),
    /// i32 and i64 values.
    I64(Vec<i64>),
}

impl TensorData {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::I64(v) => v.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Physical layout of a tensor in device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Storage {
    /// Row-major, as the logical shape.
    Plain,
    /// Per-token-group FP8 scales, packed UE8M0: the logical `[T, C]` i32
    /// words are stored column-major with a column stride of `round_up(T, 4)`
    /// words, `T + (C - 1) * round_up(T, 4)` words in all, padding zeroed
    /// (DeepGEMM's layout, vLLM's allocation; `numerics::quant::GroupScaleLayout`).
    PackedUe8m0Scales,
    /// NVFP4 e4m3 block scales, logical `[T, H / 16]`, stored in this layout.
    Nvfp4Scales(Nvfp4ScaleLayout),
}

/// A concrete tensor: dtype, shape, values (logical row-major) and storage.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Element type.
    pub dtype: DType,
    /// Concrete shape, outermost first (`[]` is a scalar).
    pub shape: Vec<usize>,
    /// Values, `shape.iter().product()` of them.
    pub data: TensorData,
    /// Physical layout.
    pub storage: Storage,
}

/// The floating format of a float dtype (bf16, f16, f32: the activation dtypes,
/// [`DType::activation`]), `None` otherwise.
pub fn float_format(dtype: DType) -> Option<FloatFormat> {
    dtype.activation().map(FloatFormat::from)
}

/// True for dtypes held as [`TensorData::I64`].
pub fn is_int_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::I32 | DType::I64)
}

/// Element count of a shape, checked.
pub fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

impl Tensor {
    /// A tensor from f32 values; errors when the count does not match the
    /// shape or the dtype is an integer type.
    pub fn from_f32(dtype: DType, shape: Vec<usize>, values: Vec<f32>) -> Result<Tensor> {
        if is_int_dtype(dtype) {
            return Err(ReferenceError::InvalidParameter(format!(
                "{dtype} tensors hold integers"
            )));
        }
        check_len(&shape, values.len())?;
        Ok(Tensor {
            dtype,
            shape,
            data: TensorData::F32(values),
            storage: Storage::Plain,
        })
    }

    /// A tensor from integer values (i32 / i64 dtypes; i32 values must fit).
    pub fn from_i64(dtype: DType, shape: Vec<usize>, values: Vec<i64>) -> Result<Tensor> {
        if !is_int_dtype(dtype) {
            return Err(ReferenceError::InvalidParameter(format!(
                "{dtype} tensors hold f32 values"
            )));
        }
        if dtype == DType::I32 && values.iter().any(|&v| i32::try_from(v).is_err()) {
            return Err(ReferenceError::InvalidParameter(
                "i32 tensor value out of range".into(),
            ));
        }
        check_len(&shape, values.len())?;
        Ok(Tensor {
            dtype,
            shape,
            data: TensorData::I64(values),
            storage: Storage::Plain,
        })
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// The f32 values, or `None` for integer tensors.
    pub fn f32s(&self) -> Option<&[f32]> {
        match &self.data {
            TensorData::F32(v) => Some(v),
            TensorData::I64(_) => None,
        }
    }

    /// The integer values, or `None` for f32-held tensors.
    pub fn i64s(&self) -> Option<&[i64]> {
        match &self.data {
            TensorData::I64(v) => Some(v),
            TensorData::F32(_) => None,
        }
    }

    /// The memory image the kernels write: little-endian elements of
    /// `dtype.size_bytes()` bytes, in the tensor's [`Storage`] layout.
    /// Float types give their IEEE bits, fp8 the e4m3 code, ue8m0 the
    /// exponent code, fp4x2 and u8 the byte.
    pub fn physical_bytes(&self) -> Result<Vec<u8>> {
        match self.storage {
            Storage::Plain => self.plain_bytes(),
            Storage::PackedUe8m0Scales => {
                let words = self
                    .i64s()
                    .ok_or_else(|| layout_err("packed scales must be i32"))?;
                let (t, c) = self.rows_cols()?;
                let padded = t
                    .div_ceil(4)
                    .checked_mul(4)
                    .ok_or(ReferenceError::SizeOverflow("padded tokens"))?;
                let n = packed_group_scale_words(t, c)?
                    .checked_mul(4)
                    .ok_or(ReferenceError::SizeOverflow("packed scale bytes"))?;
                let mut out = vec![0u8; n];
                for r in 0..t {
                    for j in 0..c {
                        let w = words[r * c + j] as i32;
                        let at = (j * padded + r) * 4;
                        out[at..at + 4].copy_from_slice(&w.to_le_bytes());
                    }
                }
                Ok(out)
            }
            Storage::Nvfp4Scales(layout) => {
                let vals = self
                    .f32s()
                    .ok_or_else(|| layout_err("NVFP4 scales must be e4m3"))?;
                let (t, c) = self.rows_cols()?;
                let hidden = c
                    .checked_mul(16)
                    .ok_or(ReferenceError::SizeOverflow("NVFP4 hidden"))?
                    as u64;
                let n = nvfp4_scale_bytes(t as u64, hidden, layout)?;
                let mut out = vec![
                    0u8;
                    usize::try_from(n).map_err(|_| ReferenceError::SizeOverflow(
                        "NVFP4 scale bytes"
                    ))?
                ];
                for r in 0..t {
                    for j in 0..c {
                        let off = nvfp4_scale_offset(r as u64, j as u64, t as u64, hidden, layout)?;
                        out[off as usize] = e4m3_satfinite(vals[r * c + j]);
                    }
                }
                Ok(out)
            }
        }
    }

    /// (rows, cols) of the tensor viewed as `[leading product, last dim]`.
    fn rows_cols(&self) -> Result<(usize, usize)> {
        let c = *self
            .shape
            .last()
            .ok_or_else(|| layout_err("scale tensor has rank 0"))?;
        let r = self.numel().checked_div(c).unwrap_or(0);
        Ok((r, c))
    }

    fn plain_bytes(&self) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        match (&self.data, self.dtype) {
            (TensorData::I64(v), DType::I32) => {
                v.iter().for_each(|&x| out.extend((x as i32).to_le_bytes()))
            }
            (TensorData::I64(v), _) => v.iter().for_each(|&x| out.extend(x.to_le_bytes())),
            (TensorData::F32(v), dt) => {
                for &x in v {
                    match dt {
                        DType::Bf16 | DType::F16 => {
                            let f = float_format(dt).unwrap_or(FloatFormat::F32);
                            out.extend((f.to_bits(x) as u16).to_le_bytes());
                        }
                        DType::F32 => out.extend(x.to_bits().to_le_bytes()),
                        DType::Fp8E4m3 => out.push(e4m3_satfinite(x)),
                        DType::Ue8m0 => out.push(crate::numerics::ue8m0::ue8m0_round_up(x)),
                        _ => out.push(x as u8),
                    }
                }
            }
        }
        Ok(out)
    }
}

fn layout_err(msg: &str) -> ReferenceError {
    ReferenceError::InvalidParameter(msg.to_string())
}

fn check_len(shape: &[usize], len: usize) -> Result<()> {
    let n = numel(shape).ok_or(ReferenceError::SizeOverflow("tensor element count"))?;
    if n != len {
        return Err(ReferenceError::InvalidShape(format!(
            "shape {shape:?} needs {n} values, got {len}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_bytes_per_dtype() {
        let t = Tensor::from_f32(DType::Bf16, vec![2], vec![1.0, -0.0]).unwrap();
        assert_eq!(t.physical_bytes().unwrap(), vec![0x80, 0x3F, 0x00, 0x80]);
        let t = Tensor::from_f32(DType::Fp8E4m3, vec![2], vec![448.0, -1.0]).unwrap();
        assert_eq!(t.physical_bytes().unwrap(), vec![0x7E, 0xB8]);
        let t = Tensor::from_i64(DType::I32, vec![1], vec![-2]).unwrap();
        assert_eq!(t.physical_bytes().unwrap(), vec![0xFE, 0xFF, 0xFF, 0xFF]);
        assert!(Tensor::from_f32(DType::F32, vec![3], vec![1.0]).is_err());
        assert!(Tensor::from_i64(DType::I32, vec![1], vec![1 << 40]).is_err());
        assert!(Tensor::from_f32(DType::I64, vec![1], vec![1.0]).is_err());
    }

    #[test]
    fn packed_scale_image_is_column_major_padded() {
        // Logical [T = 2, C = 2] words -> column stride 4, column-major; the last
        // column has T = 2 words only (2 + 1 * 4 = 6 words).
        let mut t = Tensor::from_i64(DType::I32, vec![2, 2], vec![1, 2, 3, 4]).unwrap();
        t.storage = Storage::PackedUe8m0Scales;
        let b = t.physical_bytes().unwrap();
        assert_eq!(b.len(), 24);
        let words: Vec<i32> = b
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(words, vec![1, 3, 0, 0, 2, 4]);
    }

    #[test]
    fn nvfp4_scale_image_is_swizzled() {
        // Logical [2, 2] scales (H = 32).
        let mut t = Tensor::from_f32(DType::Fp8E4m3, vec![2, 2], vec![1.0, 2.0, 0.5, 0.0]).unwrap();
        t.storage = Storage::Nvfp4Scales(Nvfp4ScaleLayout::Swizzled128x4);
        let b = t.physical_bytes().unwrap();
        assert_eq!(b.len(), 512);
        assert_eq!((b[0], b[1], b[16], b[17]), (0x38, 0x40, 0x30, 0x00));
        t.storage = Storage::Nvfp4Scales(Nvfp4ScaleLayout::Linear);
        assert_eq!(t.physical_bytes().unwrap(), vec![0x38, 0x40, 0x30, 0x00]);
    }
}
