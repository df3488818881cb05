//! NVRTC, loaded at run time with `libloading`.
//!
//! Why not cudarc's NVRTC module: cudarc 0.16 panics when `libnvrtc` is absent, and its
//! loader requires every NVRTC 12.8 symbol, including `nvrtcGetNVVM`, which NVRTC 13
//! removed (the GPU machine of this project runs CUDA 13.0). This module needs only
//! the eleven calls it uses and returns [`Error::NvrtcMissing`] instead of panicking.
//!
//! Library search order (first that loads and has every symbol wins):
//! 1. `$ARFUSE_NVRTC_PATH` (a file);
//! 2. the dynamic loader's own search (`libnvrtc.so`, `.so.13`, `.so.12`);
//! 3. `$CUDA_HOME/lib64`, `$CUDA_PATH/lib64`, `/usr/local/cuda/lib64`;
//! 4. the PyPI wheels in every Python site-packages folder (`nvidia/cuda_nvrtc/lib` of
//!    `nvidia-cuda-nvrtc-cu12`, `nvidia/cu13/lib` of `nvidia-cuda-nvrtc` 13.x), found by
//!    asking `python3` for its paths. So tests need no environment variable once
//!    `.ci/install-cuda-wheels.sh` has run.

use crate::error::{Error, Result};
use std::ffi::{c_char, c_int, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

type NvrtcResult = c_int;
type Program = *mut std::ffi::c_void;

/// The NVRTC entry points this crate uses, resolved from one library.
pub struct Nvrtc {
    path: String,
    version: (i32, i32),
    create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult,
    destroy: unsafe extern "C" fn(*mut Program) -> NvrtcResult,
    log_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    log: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    ptx_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    ptx: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    cubin_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    cubin: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    // Keeps the symbols above valid for the life of the process.
    _lib: libloading::Library,
}

// SAFETY: NVRTC is thread safe for distinct programs (documented by NVIDIA: "NVRTC
// API calls are thread safe" since CUDA 11); we only hold plain function pointers.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

/// Output of one successful compilation.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// PTX text (empty if NVRTC produced none for a real-architecture target).
    pub ptx: String,
    /// SASS cubin for the real architecture (`sm_90a`, `sm_100a`).
    pub cubin: Vec<u8>,
    /// The program log (ptxas `--verbose` output included when requested).
    pub log: String,
}

/// Register and spill figures that `ptxas --verbose` printed for one kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PtxasStats {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores per thread.
    pub spill_stores: u32,
    /// Bytes of spill loads per thread.
    pub spill_loads: u32,
    /// Bytes of local memory (stack frame) per thread.
    pub stack_frame: u32,
}

impl PtxasStats {
    /// Parses the `ptxas info` lines of an NVRTC log compiled with
    /// `--ptxas-options=--verbose`. Returns `None` when no such line is present.
    pub fn parse(log: &str) -> Option<PtxasStats> {
        let mut stats = PtxasStats::default();
        let mut seen = false;
        for line in log.lines() {
            if let Some(n) = number_before(line, " registers") {
                stats.registers = stats.registers.max(n);
                seen = true;
            }
            if let Some(n) = number_before(line, " bytes spill stores") {
                stats.spill_stores = stats.spill_stores.max(n);
            }
            if let Some(n) = number_before(line, " bytes spill loads") {
                stats.spill_loads = stats.spill_loads.max(n);
            }
            if let Some(n) = number_before(line, " bytes stack frame") {
                stats.stack_frame = stats.stack_frame.max(n);
            }
        }
        seen.then_some(stats)
    }
}

/// Finds the integer immediately before `suffix` in `line`.
fn number_before(line: &str, suffix: &str) -> Option<u32> {
    let end = line.find(suffix)?;
    let head = &line[..end];
    let start = head
        .rfind(|c: char| !c.is_ascii_digit())
        .map_or(0, |i| i + 1);
    head[start..].parse().ok()
}

static NVRTC: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();

/// Returns the process-wide NVRTC, loading it on first use.
///
/// # Errors
/// [`Error::NvrtcMissing`] when no candidate library loads (the list of candidates is
/// in the message).
pub fn nvrtc() -> Result<&'static Nvrtc> {
    match NVRTC.get_or_init(load) {
        Ok(n) => Ok(n),
        Err(searched) => Err(Error::NvrtcMissing {
            searched: searched.clone(),
        }),
    }
}

/// Whether an NVRTC library can be loaded on this machine.
pub fn available() -> bool {
    nvrtc().is_ok()
}

fn load() -> std::result::Result<Nvrtc, String> {
    let mut tried = Vec::new();
    for cand in candidates() {
        match Nvrtc::open(&cand) {
            Ok(n) => return Ok(n),
            Err(e) => tried.push(format!("{cand}: {e}")),
        }
    }
    Err(tried.join("; "))
}

/// Every library name or path to try, in order (see the module documentation).
pub fn candidates() -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(p) = std::env::var("ARFUSE_NVRTC_PATH") {
        if !p.is_empty() {
            out.push(p);
        }
    }
    for name in ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"] {
        out.push(name.to_string());
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(v) = std::env::var(var) {
            dirs.push(Path::new(&v).join("lib64"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    for sp in python_site_dirs() {
        for sub in [
            "nvidia/cu13/lib",
            "nvidia/cuda_nvrtc/lib",
            "nvidia/cu12/lib",
        ] {
            dirs.push(sp.join(sub));
        }
    }
    for d in dirs {
        for name in ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"] {
            let p = d.join(name);
            if p.is_file() {
                let s = p.to_string_lossy().into_owned();
                if !out.contains(&s) {
                    out.push(s);
                }
            }
        }
    }
    out
}

/// Python `site-packages` folders: asked from `python3` (if it runs), plus the usual
/// system locations.
fn python_site_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let script = "import site,sys\nfor p in site.getsitepackages()+[site.getusersitepackages()]+sys.path: print(p)";
    for py in ["python3", "python"] {
        if let Ok(out) = std::process::Command::new(py)
            .args(["-c", script])
            .stderr(std::process::Stdio::null())
            .output()
        {
            if out.status.success() {
                for line in String::from_utf8_lossy(&out.stdout).lines() {
                    let p = PathBuf::from(line.trim());
                    if !line.trim().is_empty() && !dirs.contains(&p) {
                        dirs.push(p);
                    }
                }
                break;
            }
        }
    }
    for root in ["/usr/lib", "/usr/local/lib"] {
        if let Ok(rd) = std::fs::read_dir(root) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("python3") {
                    for sub in ["site-packages", "dist-packages"] {
                        dirs.push(e.path().join(sub));
                    }
                }
            }
        }
    }
    dirs
}

macro_rules! sym {
    ($lib:expr, $path:expr, $name:literal) => {{
        // SAFETY: the type of each symbol is that of the NVRTC C API (nvrtc.h),
        // stable across NVRTC 11-13.
        let s: libloading::Symbol<'_, _> = unsafe { $lib.get(concat!($name, "\0").as_bytes()) }
            .map_err(|_| format!("missing symbol {} in {}", $name, $path))?;
        *s
    }};
}

impl Nvrtc {
    fn open(path: &str) -> std::result::Result<Nvrtc, String> {
        // SAFETY: loading libnvrtc runs its initialisers, which have no preconditions.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        let version_fn: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult =
            sym!(lib, path, "nvrtcVersion");
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        let rc = unsafe { version_fn(&mut major, &mut minor) };
        if rc != 0 {
            return Err(format!("nvrtcVersion returned {rc}"));
        }
        Ok(Nvrtc {
            path: path.to_string(),
            version: (major, minor),
            create: sym!(lib, path, "nvrtcCreateProgram"),
            compile: sym!(lib, path, "nvrtcCompileProgram"),
            destroy: sym!(lib, path, "nvrtcDestroyProgram"),
            log_size: sym!(lib, path, "nvrtcGetProgramLogSize"),
            log: sym!(lib, path, "nvrtcGetProgramLog"),
            ptx_size: sym!(lib, path, "nvrtcGetPTXSize"),
            ptx: sym!(lib, path, "nvrtcGetPTX"),
            cubin_size: sym!(lib, path, "nvrtcGetCUBINSize"),
            cubin: sym!(lib, path, "nvrtcGetCUBIN"),
            error_string: sym!(lib, path, "nvrtcGetErrorString"),
            _lib: lib,
        })
    }

    /// Path or name the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// NVRTC version `(major, minor)`, e.g. `(12, 9)`.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Whether this NVRTC can target `sm_100a` (needs NVRTC >= 12.8).
    pub fn supports_sm100a(&self) -> bool {
        self.version >= (12, 8)
    }

    fn err_name(&self, rc: NvrtcResult) -> String {
        // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string.
        let p = unsafe { (self.error_string)(rc) };
        if p.is_null() {
            return format!("NVRTC error {rc}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }

    /// Compiles `source` (named `name` in diagnostics) with the given in-memory
    /// headers `(include name, text)` and options (`--gpu-architecture=sm_90a`,
    /// `-DNAME=VALUE`, ...). With a real architecture (`sm_*`) NVRTC also runs ptxas
    /// and returns a cubin, so inline PTX is checked too.
    ///
    /// # Errors
    /// [`Error::Compile`] with the log when compilation fails; `variant`/`arch` are
    /// filled from `name` and the `--gpu-architecture` option.
    pub fn compile(
        &self,
        name: &str,
        source: &str,
        headers: &[(&str, &str)],
        options: &[String],
    ) -> Result<Compiled> {
        let arch = options
            .iter()
            .find_map(|o| o.strip_prefix("--gpu-architecture="))
            .unwrap_or("default")
            .to_string();
        let cerr = |what: &str| Error::Compile {
            variant: name.to_string(),
            arch: arch.clone(),
            code: format!("interior NUL byte in {what}"),
            log: String::new(),
        };
        let c_src = CString::new(source).map_err(|_| cerr("source"))?;
        let c_name = CString::new(format!("{name}.cu")).map_err(|_| cerr("name"))?;
        let mut h_names = Vec::with_capacity(headers.len());
        let mut h_srcs = Vec::with_capacity(headers.len());
        for (n, s) in headers {
            h_names.push(CString::new(*n).map_err(|_| cerr("header name"))?);
            h_srcs.push(CString::new(*s).map_err(|_| cerr("header"))?);
        }
        let h_name_ptrs: Vec<*const c_char> = h_names.iter().map(|c| c.as_ptr()).collect();
        let h_src_ptrs: Vec<*const c_char> = h_srcs.iter().map(|c| c.as_ptr()).collect();
        let c_opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| cerr("option"))?;
        let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|c| c.as_ptr()).collect();
        let n_headers = c_int::try_from(headers.len()).map_err(|_| cerr("header count"))?;
        let n_opts = c_int::try_from(options.len()).map_err(|_| cerr("option count"))?;

        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: all pointers are valid NUL-terminated strings that outlive the call;
        // the arrays have `n_headers` entries.
        let rc = unsafe {
            (self.create)(
                &mut prog,
                c_src.as_ptr(),
                c_name.as_ptr(),
                n_headers,
                if headers.is_empty() {
                    std::ptr::null()
                } else {
                    h_src_ptrs.as_ptr()
                },
                if headers.is_empty() {
                    std::ptr::null()
                } else {
                    h_name_ptrs.as_ptr()
                },
            )
        };
        if rc != 0 {
            return Err(Error::Compile {
                variant: name.to_string(),
                arch,
                code: self.err_name(rc),
                log: "nvrtcCreateProgram failed".into(),
            });
        }
        let guard = ProgramGuard { nvrtc: self, prog };
        // SAFETY: `prog` is a live program; options array has `n_opts` entries.
        let rc = unsafe { (self.compile)(guard.prog, n_opts, opt_ptrs.as_ptr()) };
        let log = self.fetch(guard.prog, self.log_size, self.log)?;
        let log = String::from_utf8_lossy(trim_nul(&log)).into_owned();
        if rc != 0 {
            return Err(Error::Compile {
                variant: name.to_string(),
                arch,
                code: self.err_name(rc),
                log,
            });
        }
        let ptx = self
            .fetch(guard.prog, self.ptx_size, self.ptx)
            .unwrap_or_default();
        let ptx = String::from_utf8_lossy(trim_nul(&ptx)).into_owned();
        let cubin = if arch.starts_with("sm_") {
            self.fetch(guard.prog, self.cubin_size, self.cubin)?
        } else {
            Vec::new()
        };
        Ok(Compiled { ptx, cubin, log })
    }

    fn fetch(
        &self,
        prog: Program,
        size_fn: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
        get_fn: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    ) -> Result<Vec<u8>> {
        let mut n = 0usize;
        // SAFETY: live program, valid out-pointer.
        let rc = unsafe { size_fn(prog, &mut n) };
        if rc != 0 {
            return Err(Error::Compile {
                variant: String::new(),
                arch: String::new(),
                code: self.err_name(rc),
                log: "querying an NVRTC output size failed".into(),
            });
        }
        let mut buf = vec![0u8; n.max(1)];
        if n > 0 {
            // SAFETY: `buf` holds `n` bytes as NVRTC asked.
            let rc = unsafe { get_fn(prog, buf.as_mut_ptr().cast()) };
            if rc != 0 {
                return Err(Error::Compile {
                    variant: String::new(),
                    arch: String::new(),
                    code: self.err_name(rc),
                    log: "fetching an NVRTC output failed".into(),
                });
            }
        }
        buf.truncate(n);
        Ok(buf)
    }
}

fn trim_nul(b: &[u8]) -> &[u8] {
    match b.iter().position(|&c| c == 0) {
        Some(i) => &b[..i],
        None => b,
    }
}

struct ProgramGuard<'a> {
    nvrtc: &'a Nvrtc,
    prog: Program,
}

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: `prog` was created by nvrtcCreateProgram and is destroyed once.
        unsafe {
            (self.nvrtc.destroy)(&mut self.prog);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ptxas_verbose_lines() {
        let log = "ptxas info    : Compiling entry function 'arf_fused' for 'sm_90a'\n\
                   ptxas info    : Function properties for arf_fused\n\
                   \x20   16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 72 registers, 1000 bytes cmem[0]\n";
        let s = PtxasStats::parse(log).unwrap();
        assert_eq!(
            s,
            PtxasStats {
                registers: 72,
                spill_stores: 8,
                spill_loads: 12,
                stack_frame: 16
            }
        );
        assert_eq!(PtxasStats::parse("no ptxas here"), None);
    }
}
