//! Host memory for host-compiled kernels: zeroed, aligned buffers whose addresses go
//! into `KernelParams`, and the W virtual ranks' workspaces.

use crate::device::KernelParams;
use crate::error::{Error, Result};
use crate::variants::ActDtype;
use arfuse_policy::{ArfuseLayout, Workspace};
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

/// Bytes of the guard gap after every slot of a [`Slots`] buffer.
pub const GUARD_GAP: usize = 256;
/// The byte every guard gap holds; a kernel that wrote past a slot changed it.
pub const GUARD_BYTE: u8 = 0x5A;

/// The AddressSanitizer runtime's manual poisoning, when this process has one (a
/// sanitized run preloads it; elsewhere this is `None`).
struct AsanHooks {
    poison: unsafe extern "C" fn(*const u8, usize),
    unpoison: unsafe extern "C" fn(*const u8, usize),
}

fn asan_hooks() -> Option<&'static AsanHooks> {
    static HOOKS: std::sync::OnceLock<Option<AsanHooks>> = std::sync::OnceLock::new();
    HOOKS
        .get_or_init(|| {
            let this = libloading::os::unix::Library::this();
            // SAFETY: both are `void f(void const volatile *addr, size_t size)` in the
            // ASan interface (sanitizer/asan_interface.h).
            unsafe {
                let p = this.get::<unsafe extern "C" fn(*const u8, usize)>(
                    b"__asan_poison_memory_region\0",
                );
                let u = this.get::<unsafe extern "C" fn(*const u8, usize)>(
                    b"__asan_unpoison_memory_region\0",
                );
                match (p, u) {
                    (Ok(p), Ok(u)) => Some(AsanHooks {
                        poison: *p,
                        unpoison: *u,
                    }),
                    _ => None,
                }
            }
        })
        .as_ref()
}

/// `count` slots of `size` bytes in one [`HostBuffer`], each followed by a
/// [`GUARD_GAP`]-byte gap filled with [`GUARD_BYTE`] (and poisoned when the process
/// runs under AddressSanitizer, so a sanitized kernel reading it is reported). Slot i
/// starts at `addr(0) + i * stride()`: what a kernel sees as `ptr + rank * rank_stride`.
pub struct Slots {
    buf: HostBuffer,
    size: usize,
    stride: usize,
    count: usize,
}

impl Slots {
    /// `count` zeroed slots of `size` bytes.
    ///
    /// # Errors
    /// As [`HostBuffer::new`]; [`Error::Overflow`] on absurd sizes.
    pub fn new(size: u64, count: u32) -> Result<Slots> {
        let size = usize::try_from(size).map_err(|_| Error::Overflow("slot size"))?;
        let count = count.max(1) as usize;
        let stride = size
            .checked_add(63)
            .map(|v| v / 64 * 64)
            .and_then(|v| v.checked_add(GUARD_GAP))
            .ok_or(Error::Overflow("slot stride"))?;
        let total = stride.checked_mul(count).ok_or(Error::Overflow("slots"))?;
        let mut buf = HostBuffer::new(total as u64)?;
        for i in 0..count {
            buf.bytes_mut()[i * stride + size..(i + 1) * stride].fill(GUARD_BYTE);
        }
        let s = Slots {
            buf,
            size,
            stride,
            count,
        };
        if let Some(h) = asan_hooks() {
            for i in 0..count {
                let gap = s.buf.addr() as usize + i * stride + size;
                // SAFETY: the gap lies inside this buffer.
                unsafe { (h.poison)(gap as *const u8, stride - size) };
            }
        }
        Ok(s)
    }

    /// Address of slot `i` (slot 0 for `i` beyond the last).
    pub fn addr(&self, i: usize) -> u64 {
        self.buf.addr() + (i.min(self.count - 1) * self.stride) as u64
    }

    /// Bytes from one slot's start to the next's.
    pub fn stride(&self) -> u64 {
        self.stride as u64
    }

    /// Bytes of one slot.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Slot `i`.
    pub fn slot(&self, i: usize) -> &[u8] {
        let i = i.min(self.count - 1);
        &self.buf.bytes()[i * self.stride..i * self.stride + self.size]
    }

    /// Slot `i`, writable.
    pub fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        let i = i.min(self.count - 1);
        let (a, n) = (i * self.stride, self.size);
        &mut self.buf.bytes_mut()[a..a + n]
    }

    /// Fills every slot (not the gaps) with `byte`.
    pub fn fill(&mut self, byte: u8) {
        for i in 0..self.count {
            self.slot_mut(i).fill(byte);
        }
    }

    /// The first slot whose guard gap no longer holds [`GUARD_BYTE`] everywhere (a
    /// write past its end), if any.
    pub fn overrun(&self) -> Option<usize> {
        let b = self.buf.bytes();
        (0..self.count).find(|&i| {
            b[i * self.stride + self.size..(i + 1) * self.stride]
                .iter()
                .any(|&x| x != GUARD_BYTE)
        })
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        if let Some(h) = asan_hooks() {
            // SAFETY: the whole buffer, before it is freed.
            unsafe { (h.unpoison)(self.buf.addr() as *const u8, self.buf.len()) };
        }
    }
}

/// The W ranks' workspaces, one host allocation per rank (as W GPUs would have; the
/// kernels reach every peer only through `KernelParams::peer`, so an overrun of one
/// rank's workspace is an overrun of its allocation, which the sanitized build
/// reports), initialised as the CUDA path initialises them (Lamport buffers to the
/// -0.0 sentinel, the rest zero), plus the kernels' error word.
pub struct HostWorkspace {
    /// The workspace (the plan's, per rank).
    pub workspace: Workspace,
    /// Its byte offsets (one rank).
    pub layout: ArfuseLayout,
    ranks: Vec<Slots>,
    err: Slots,
}

/// One rank's workspace bytes in their initial state: the state block (everything
/// before the Lamport buffers) zero, every element of the Lamport buffers the -0.0
/// sentinel of `dtype`.
pub(crate) fn initialise_rank(
    bytes: &mut [u8],
    layout: &ArfuseLayout,
    dtype: ActDtype,
) -> Result<()> {
    let bits = dtype.sentinel_bits().to_le_bytes();
    let word = &bits[..dtype.element_bytes() as usize];
    let size = |v: u64| usize::try_from(v).map_err(|_| Error::Overflow("workspace"));
    let start = size(layout.lamport_offset)?;
    let lam = size(
        layout
            .lamport_buffer_bytes
            .checked_mul(arfuse_abi::LAMPORT_BUFFER_COUNT)
            .ok_or(Error::Overflow("lamport"))?,
    )?;
    let end = start.checked_add(lam).ok_or(Error::Overflow("lamport"))?;
    if end > bytes.len() {
        return Err(Error::Overflow("lamport"));
    }
    bytes[..start].fill(0);
    for chunk in bytes[start..end].chunks_exact_mut(word.len()) {
        chunk.copy_from_slice(word);
    }
    Ok(())
}

impl HostWorkspace {
    /// Allocates and initialises `workspace` (arfuse's layout) for its W ranks.
    ///
    /// # Errors
    /// As [`crate::device::arfuse_layout`] and [`HostBuffer::new`].
    pub fn create(workspace: &Workspace) -> Result<HostWorkspace> {
        let layout = crate::device::arfuse_layout(workspace)?;
        let mut ranks = Vec::with_capacity(workspace.world_size as usize);
        for _ in 0..workspace.world_size {
            let mut b = Slots::new(layout.bytes_per_rank, 1)?;
            initialise_rank(b.slot_mut(0), &layout, workspace.dtype)?;
            ranks.push(b);
        }
        Ok(HostWorkspace {
            workspace: workspace.clone(),
            layout,
            ranks,
            err: Slots::new(16, 1)?,
        })
    }

    /// Writes the initial state again (as [`HostWorkspace::create`] left it: state
    /// blocks zero, Lamport buffers the sentinel, the error word zero), through a
    /// shared reference, for a workspace that queued launches share
    /// ([`super::device::HostDevice`]); only called when no kernel runs.
    ///
    /// # Errors
    /// As [`HostWorkspace::create`].
    pub(crate) fn reset_shared(&self) -> Result<()> {
        let len = usize::try_from(self.layout.bytes_per_rank)
            .map_err(|_| Error::Overflow("workspace"))?;
        for b in &self.ranks {
            // SAFETY: the rank's slot holds `bytes_per_rank` bytes at `addr(0)`; no
            // kernel runs (the caller ran the queue and holds the device exclusively)
            // and no other reference into the slot is alive while this one is.
            let bytes = unsafe { std::slice::from_raw_parts_mut(b.addr(0) as *mut u8, len) };
            initialise_rank(bytes, &self.layout, self.workspace.dtype)?;
        }
        // SAFETY: the first 4 bytes of the error word's slot, as in take_error_shared.
        unsafe { std::ptr::write_volatile(self.err.addr(0) as *mut u32, 0) };
        Ok(())
    }

    /// `base` with the workspace fields filled (every rank's workspace address, the
    /// region offsets, the error word, M).
    ///
    /// # Errors
    /// As [`KernelParams::with_virtual_workspace`].
    pub fn params(&self, base: KernelParams) -> Result<KernelParams> {
        let world = self.workspace.world_size;
        let mut p = base.with_virtual_workspace(&self.layout, world, 0, self.err.addr(0))?;
        for (r, b) in self.ranks.iter().enumerate() {
            p.peer[r] = b.addr(0);
        }
        Ok(p)
    }

    /// Address of rank 0's workspace (identifies this workspace).
    pub fn base(&self) -> u64 {
        self.ranks[0].addr(0)
    }

    /// The error word the kernels set instead of hanging (0: none).
    pub fn error_word(&self) -> u32 {
        let b = self.err.slot(0);
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Reads and clears the error word; `Err(KernelTimeout)` if a kernel gave up.
    pub fn take_error(&mut self) -> Result<()> {
        self.take_error_shared()
    }

    /// [`HostWorkspace::take_error`] through a shared reference, for a workspace that
    /// queued launches share ([`super::device::HostDevice`]); only called when no
    /// kernel runs.
    pub(crate) fn take_error_shared(&self) -> Result<()> {
        let v = self.error_word();
        if v != 0 {
            // SAFETY: the first 4 bytes of the error word's slot, which this value owns;
            // no kernel runs and no reference into the slot is held while this writes.
            unsafe { std::ptr::write_volatile(self.err.addr(0) as *mut u32, 0) };
            return Err(Error::KernelTimeout(v));
        }
        Ok(())
    }

    /// Rank r's workspace bytes (for inspecting the protocol state).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a rank outside the world.
    pub fn rank_bytes(&self, rank: u32) -> Result<&[u8]> {
        self.ranks
            .get(rank as usize)
            .map(|s| s.slot(0))
            .ok_or_else(|| Error::Invalid(format!("rank {rank} of {}", self.ranks.len())))
    }

    /// An error naming the first rank whose workspace (or the error word) a kernel
    /// wrote past.
    ///
    /// # Errors
    /// [`Error::HostKernel`] for an overrun.
    pub fn check_bounds(&self) -> Result<()> {
        for (r, s) in self.ranks.iter().enumerate() {
            if s.overrun().is_some() {
                return Err(Error::HostKernel {
                    variant: "(workspace)".into(),
                    msg: format!("a kernel wrote past the end of rank {r}'s workspace"),
                });
            }
        }
        if self.err.overrun().is_some() {
            return Err(Error::HostKernel {
                variant: "(workspace)".into(),
                msg: "a kernel wrote past the error word".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_keep_their_stride_and_catch_writes_past_a_slot() {
        let mut s = Slots::new(100, 3).unwrap();
        assert_eq!(s.stride(), 128 + GUARD_GAP as u64);
        assert_eq!(s.addr(2) - s.addr(0), 2 * s.stride());
        assert_eq!(s.addr(0) % HOST_ALIGN as u64, 0);
        s.fill(7);
        assert!(s.slot(1).iter().all(|&b| b == 7));
        assert_eq!(s.overrun(), None);
        // One byte past slot 1 (a kernel's off-by-one), through the raw address.
        // SAFETY: inside the buffer (the gap after slot 1).
        unsafe { *((s.addr(1) + 100) as *mut u8) = 0 };
        assert_eq!(s.overrun(), Some(1));
    }

    #[test]
    fn workspace_starts_with_sentinels_and_separate_ranks() {
        let ws =
            HostWorkspace::create(&crate::check::workspace_for(2, ActDtype::Bf16, 256, 4).unwrap())
                .unwrap();
        let p = ws.params(KernelParams::default()).unwrap();
        assert_eq!(p.peer[0], ws.base());
        assert_ne!(p.peer[1], 0);
        assert_eq!(p.off_lamport, ws.layout.lamport_offset);
        let r1 = ws.rank_bytes(1).unwrap();
        let lam = &r1[ws.layout.lamport_offset as usize..][..16];
        assert_eq!(lam, [0x00, 0x80].repeat(8).as_slice());
        assert!(r1[..ws.layout.lamport_offset as usize]
            .iter()
            .all(|&b| b == 0));
        assert!(ws.check_bounds().is_ok());
        assert!(ws.rank_bytes(2).is_err());
    }
}
