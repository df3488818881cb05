//! Host memory for host-compiled kernels: zeroed, aligned buffers whose addresses go
//! into `KernelParams`, and the W virtual ranks' workspaces.

use crate::cuda::KernelParams;
use crate::error::{Error, Result};
use crate::layout::{WorkspaceLayout, WorkspaceRequest};
use crate::variants::Dtype;
use std::alloc::Layout;
use std::ptr::NonNull;

/// Alignment of every host buffer, bytes (the kernels need 16; workspace regions are
/// 256-byte aligned relative to the base).
pub const HOST_ALIGN: usize = 256;
/// Largest host buffer, bytes (16 GiB): a larger request is an error, not an attempt.
pub const MAX_HOST_BUFFER: u64 = 16 << 30;

/// A zeroed, [`HOST_ALIGN`]-aligned heap buffer that kernels address by its
/// [`HostBuffer::addr`]. Not `Sync`: only the thread that owns it reads it, and only
/// between launches.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain memory owned by this value; moving it between threads is
// fine (it is not Sync, so no two threads hold references at once).
unsafe impl Send for HostBuffer {}

impl HostBuffer {
    /// A zeroed buffer of `bytes` bytes (at least 16).
    ///
    /// # Errors
    /// [`Error::Unsupported`] above [`MAX_HOST_BUFFER`] or when the allocation fails.
    pub fn new(bytes: u64) -> Result<HostBuffer> {
        if bytes > MAX_HOST_BUFFER {
            return Err(Error::Unsupported(format!(
                "host buffer of {bytes} bytes exceeds {MAX_HOST_BUFFER}"
            )));
        }
        let n = usize::try_from(bytes.max(16)).map_err(|_| Error::Overflow("host buffer"))?;
        let layout =
            Layout::from_size_align(n, HOST_ALIGN).map_err(|_| Error::Overflow("host buffer"))?;
        // SAFETY: non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })
            .ok_or_else(|| Error::Unsupported(format!("host allocation of {n} bytes failed")))?;
        Ok(HostBuffer { ptr, layout })
    }

    /// The address kernels use.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Whether the buffer is empty (never: at least 16 bytes).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The contents.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes; no launch runs while `&self` is held by the
        // owning thread (launches borrow nothing and return only when done).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
    }

    /// The contents, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }

    /// `bytes[offset..offset + data.len()] = data`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the range overruns the buffer.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        let end = offset
            .checked_add(data.len())
            .filter(|e| *e <= self.len())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "write of {} bytes at {offset} overruns {}",
                    data.len(),
                    self.len()
                ))
            })?;
        self.bytes_mut()[offset..end].copy_from_slice(data);
        Ok(())
    }

    /// A copy of `bytes[offset..offset + len]`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the range overruns the buffer.
    pub fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= self.len())
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "read of {len} bytes at {offset} overruns {}",
                    self.len()
                ))
            })?;
        Ok(self.bytes()[offset..end].to_vec())
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The W virtual ranks' workspaces in one host buffer (rank r's slice at
/// `r * per_rank_bytes`), initialised as the CUDA path initialises them (Lamport
/// buffers to the -0.0 sentinel, the rest zero), plus the kernels' error word.
pub struct HostWorkspace {
    /// The layout of one rank.
    pub layout: WorkspaceLayout,
    memory: HostBuffer,
    err: HostBuffer,
}

impl HostWorkspace {
    /// Allocates and initialises a workspace for `request`.
    ///
    /// # Errors
    /// As [`WorkspaceLayout::new`] and [`HostBuffer::new`].
    pub fn create(request: WorkspaceRequest) -> Result<HostWorkspace> {
        let layout = WorkspaceLayout::new(request)?;
        let mut memory = HostBuffer::new(layout.virtual_bytes()?)?;
        let err = HostBuffer::new(16)?;
        let word: &[u8] = match request.dtype {
            Dtype::Bf16 | Dtype::F16 => &[0x00, 0x80],
            Dtype::F32 => &[0x00, 0x00, 0x00, 0x80],
        };
        let per =
            usize::try_from(layout.per_rank_bytes).map_err(|_| Error::Overflow("workspace"))?;
        let start =
            usize::try_from(layout.off_lamport).map_err(|_| Error::Overflow("workspace"))?;
        let lam = usize::try_from(
            layout
                .lamport_stride
                .checked_mul(3)
                .ok_or(Error::Overflow("lamport"))?,
        )
        .map_err(|_| Error::Overflow("lamport"))?;
        let bytes = memory.bytes_mut();
        for r in 0..request.world as usize {
            let base = r * per + start;
            for chunk in bytes[base..base + lam].chunks_exact_mut(word.len()) {
                chunk.copy_from_slice(word);
            }
        }
        Ok(HostWorkspace {
            layout,
            memory,
            err,
        })
    }

    /// `base` with the workspace fields filled (every rank's base address, the region
    /// offsets, the error word, M).
    ///
    /// # Errors
    /// As [`KernelParams::with_virtual_workspace`].
    pub fn params(&self, base: KernelParams) -> Result<KernelParams> {
        base.with_virtual_workspace(&self.layout, self.memory.addr(), self.err.addr())
    }

    /// Address of rank 0's slice (rank r at `base + r * per_rank_bytes`).
    pub fn base(&self) -> u64 {
        self.memory.addr()
    }

    /// The error word the kernels set instead of hanging (0: none).
    pub fn error_word(&self) -> u32 {
        let b = self.err.bytes();
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Reads and clears the error word; `Err(KernelTimeout)` if a kernel gave up.
    pub fn take_error(&mut self) -> Result<()> {
        let v = self.error_word();
        if v != 0 {
            self.err.bytes_mut()[..4].fill(0);
            return Err(Error::KernelTimeout(v));
        }
        Ok(())
    }

    /// Rank r's slice of the workspace (for inspecting the protocol state).
    pub fn rank_bytes(&self, rank: u32) -> Result<&[u8]> {
        let per = usize::try_from(self.layout.per_rank_bytes)
            .map_err(|_| Error::Overflow("workspace"))?;
        let r = rank as usize;
        if rank >= self.layout.request.world {
            return Err(Error::Invalid(format!(
                "rank {rank} of {}",
                self.layout.request.world
            )));
        }
        Ok(&self.memory.bytes()[r * per..(r + 1) * per])
    }
}
