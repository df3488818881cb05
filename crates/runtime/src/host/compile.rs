//! Compiling kernel variants for the host with the machine's C++ compiler, cached.
//!
//! A variant is compiled from the same `kernels/` text NVRTC gets (embedded in this
//! crate, so a binary carries its sources), with the same `-D` defines (the ABI's,
//! [`arfuse_abi::kernel_defines`], and the variant's, [`Variant::defines`]) plus
//! `-DARF_HOST=1`, as one translation unit that includes
//! the kernel's `.cu` file and `ARF_HOST_ENTRY(<entry>)`. Output: a shared object in
//! `<cache>/<variant>-<build>-<key>/kernel.so`, where `key` hashes (SHA-256) the
//! compiler's identity, the flags, the defines and every source text; an existing
//! object with that key is loaded without compiling. The object is written under a
//! temporary name and renamed, so concurrent test processes never see half a file.

use super::launch::HostKernel;
use crate::error::{Error, Result};
use crate::variants::{self, Variant};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Source of `kernels/arfuse_host.h` (the host build's CUDA built-ins and executor).
pub const HOST_HEADER: &str = include_str!("../../../../kernels/arfuse_host.h");
/// Source of `kernels/arfuse_host_probe.cpp` (C entry points of the software `cvt`
/// conversions, for their tests).
pub const PROBE_SOURCE: &str = include_str!("../../../../kernels/arfuse_host_probe.cpp");

/// Flags of every host build: C++20, optimised, position independent, no FMA
/// contraction (the kernels' `--fmad=false`), no fast-math (IEEE division, square root
/// and subnormals, as NVRTC's defaults), only the entry points exported.
const BASE_FLAGS: &[&str] = &[
    "-std=c++20",
    "-O2",
    "-fPIC",
    "-shared",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fvisibility=hidden",
    "-mtls-dialect=gnu2",
    "-DARF_HOST=1",
];

/// Which host build of a variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Build {
    /// The plain build (what the host tests run).
    Plain,
    /// AddressSanitizer + UndefinedBehaviorSanitizer, every UB check fatal. Such an
    /// object loads only into a process that has the ASan runtime first in its
    /// library list (`LD_PRELOAD` of the compiler's `libasan.so`, see
    /// [`Compiler::asan_runtime`]); elsewhere loading fails with the loader's message.
    Sanitized,
}

impl Build {
    /// Short name used in cache directories and errors.
    pub fn name(self) -> &'static str {
        match self {
            Build::Plain => "plain",
            Build::Sanitized => "sanitized",
        }
    }

    fn flags(self) -> &'static [&'static str] {
        match self {
            Build::Plain => &[],
            // -O0 with line tables only (-g1) compiles in about half the time of -O1
            // (measured here: 0.65 s vs 1.4 s per variant); -fno-omit-frame-pointer
            // gives whole stacks in reports.
            Build::Sanitized => &[
                "-O0",
                "-g1",
                "-fno-omit-frame-pointer",
                "-fsanitize=address,undefined",
                "-fno-sanitize-recover=all",
            ],
        }
    }
}

/// One translation unit to build: its name, the kernel source file it includes (with
/// that file's text), the `-D` defines and the entry-point line.
struct Unit {
    name: String,
    source_file: &'static str,
    source_text: std::borrow::Cow<'static, str>,
    defines: Vec<(String, u32)>,
    main: String,
}

impl Unit {
    fn for_variant(v: &Variant) -> Unit {
        let source_file = match v.kind {
            variants::KernelKind::Fused { .. } => "allreduce_fused.cu",
            variants::KernelKind::Local => "unfused.cu",
            variants::KernelKind::VirtualAllReduce { .. } => "virtual_allreduce.cu",
        };
        Unit {
            name: v.name(),
            source_file,
            source_text: v.source().into(),
            defines: v.defines(),
            main: format!(
                "#include \"{source_file}\"\nARF_HOST_ENTRY({})\n",
                v.entry()
            ),
        }
    }

    fn files(&self) -> [(&str, &str); 3] {
        [
            ("arfuse_common.cuh", variants::COMMON_HEADER),
            ("arfuse_host.h", HOST_HEADER),
            (self.source_file, &self.source_text),
        ]
    }
}

/// The host C++ compiler and the object cache.
pub struct Compiler {
    cxx: String,
    identity: String,
    cache: PathBuf,
    loaded: Mutex<HashMap<(Variant, Build), Arc<HostKernel>>>,
}

/// Numbers the temporary build directories of this process (several compilers may
/// build the same unit at once; each build gets its own directory).
static TMP_COUNTER: AtomicUsize = AtomicUsize::new(0);

impl Compiler {
    /// The compiler named by `CXX` (else `g++`), caching objects under `cache_dir`
    /// (created when missing). Runs `<cxx> --version` once; its output is part of
    /// every cache key.
    ///
    /// # Errors
    /// [`Error::HostCompiler`] when the compiler cannot be run.
    pub fn new(cache_dir: impl Into<PathBuf>) -> Result<Compiler> {
        let cxx = std::env::var("CXX")
            .ok()
            .filter(|c| !c.trim().is_empty())
            .unwrap_or_else(|| "g++".to_string());
        Compiler::with(cxx, cache_dir)
    }

    /// As [`Compiler::new`] with an explicit compiler command.
    ///
    /// # Errors
    /// [`Error::HostCompiler`] when the compiler cannot be run.
    pub fn with(cxx: impl Into<String>, cache_dir: impl Into<PathBuf>) -> Result<Compiler> {
        let cxx = cxx.into();
        let bad = |reason: String| Error::HostCompiler {
            compiler: cxx.clone(),
            reason,
        };
        let out = Command::new(&cxx)
            .env_remove("LD_PRELOAD")
            .arg("--version")
            .output()
            .map_err(|e| bad(format!("cannot run it: {e}")))?;
        if !out.status.success() {
            return Err(bad(format!(
                "--version exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let identity = String::from_utf8_lossy(&out.stdout).into_owned();
        let cache = cache_dir.into();
        std::fs::create_dir_all(&cache)
            .map_err(|e| bad(format!("cache directory {}: {e}", cache.display())))?;
        Ok(Compiler {
            cxx,
            identity,
            cache,
            loaded: Mutex::new(HashMap::new()),
        })
    }

    /// The compiler command.
    pub fn command(&self) -> &str {
        &self.cxx
    }

    /// The first line of `<cxx> --version`.
    pub fn version(&self) -> &str {
        self.identity.lines().next().unwrap_or("")
    }

    /// Path of the compiler's AddressSanitizer runtime (`<cxx>
    /// -print-file-name=libasan.so`), which a process must preload to load a
    /// [`Build::Sanitized`] object.
    ///
    /// # Errors
    /// [`Error::HostCompiler`] when the compiler does not know one.
    pub fn asan_runtime(&self) -> Result<PathBuf> {
        let out = Command::new(&self.cxx)
            .env_remove("LD_PRELOAD")
            .arg("-print-file-name=libasan.so")
            .output()
            .map_err(|e| Error::HostCompiler {
                compiler: self.cxx.clone(),
                reason: e.to_string(),
            })?;
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if !out.status.success() || !p.is_absolute() || !p.exists() {
            return Err(Error::HostCompiler {
                compiler: self.cxx.clone(),
                reason: "no libasan.so (install the compiler's sanitizer runtime)".into(),
            });
        }
        Ok(p)
    }

    /// The compiled and loaded `build` of `variant` (compiled once per key, loaded once
    /// per compiler handle).
    ///
    /// # Errors
    /// [`Error::HostCompile`] with the compiler's output; [`Error::HostKernel`] when the
    /// object does not load or has the wrong ABI; I/O errors as [`Error::HostCompiler`].
    pub fn kernel(&self, variant: &Variant, build: Build) -> Result<Arc<HostKernel>> {
        if let Some(k) = self.cached(variant, build) {
            return Ok(k);
        }
        let unit = Unit::for_variant(variant);
        let path = self.object(&unit, build)?;
        let k = Arc::new(HostKernel::load(*variant, build, &path)?);
        let mut map = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        Ok(map.entry((*variant, build)).or_insert(k).clone())
    }

    /// `variant` built from `source` instead of its own `kernels/` file (a patched
    /// kernel: the headers stay those of this crate). Cached on disk under its own key
    /// like every object, not in this handle's table of loaded variants.
    ///
    /// # Errors
    /// As [`Compiler::kernel`].
    pub fn kernel_from_source(
        &self,
        variant: &Variant,
        build: Build,
        source: String,
    ) -> Result<HostKernel> {
        let mut unit = Unit::for_variant(variant);
        unit.name = format!("{}-patched", unit.name);
        unit.source_text = source.into();
        let path = self.object(&unit, build)?;
        HostKernel::load(*variant, build, &path)
    }

    fn cached(&self, variant: &Variant, build: Build) -> Option<Arc<HostKernel>> {
        let map = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&(*variant, build)).cloned()
    }

    /// Compiles (or finds in the cache) and loads every variant of `variants` in
    /// `build` on up to `threads` compiler processes at once. Returns the kernels in
    /// the order given.
    ///
    /// # Errors
    /// The first failure in the order given (as [`Compiler::kernel`]).
    pub fn kernels(
        &self,
        variants: &[Variant],
        build: Build,
        threads: usize,
    ) -> Result<Vec<Arc<HostKernel>>> {
        par_map(variants, threads, |v| self.kernel(v, build))
    }

    /// Compiles (or finds in the cache) every variant of `variants` in `build` without
    /// loading them, on up to `threads` compiler processes at once; returns the paths
    /// of the shared objects in the order given. (A [`Build::Sanitized`] object can
    /// only be loaded by a process with the ASan runtime preloaded, but it can be built
    /// anywhere.)
    ///
    /// # Errors
    /// The first failure in the order given (as [`Compiler::kernel`]).
    pub fn objects(
        &self,
        variants: &[Variant],
        build: Build,
        threads: usize,
    ) -> Result<Vec<PathBuf>> {
        par_map(variants, threads, |v| {
            self.object(&Unit::for_variant(v), build)
        })
    }

    /// Compiles the conversion probe (`kernels/arfuse_host_probe.cpp`) and returns the
    /// path of its shared object (see [`super::Conversions`]).
    ///
    /// # Errors
    /// As [`Compiler::kernel`].
    pub fn probe_object(&self) -> Result<PathBuf> {
        let unit = Unit {
            name: "probe".to_string(),
            source_file: "arfuse_host_probe.cpp",
            source_text: PROBE_SOURCE.into(),
            defines: Vec::new(),
            main: "#include \"arfuse_host_probe.cpp\"\n".to_string(),
        };
        self.object(&unit, Build::Plain)
    }

    fn key(&self, unit: &Unit, build: Build) -> String {
        let mut h = Sha256::new();
        let mut field = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        field(b"arfuse-host-object-v1");
        field(self.cxx.as_bytes());
        field(self.identity.as_bytes());
        for f in BASE_FLAGS.iter().chain(build.flags()) {
            field(f.as_bytes());
        }
        for d in arfuse_abi::kernel_defines() {
            field(d.option().as_bytes());
        }
        for (k, v) in &unit.defines {
            field(format!("-D{k}={v}").as_bytes());
        }
        for (name, text) in unit.files() {
            field(name.as_bytes());
            field(text.as_bytes());
        }
        field(unit.main.as_bytes());
        let d = h.finalize();
        d[..12].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The cached object of `unit`, compiled first when missing.
    fn object(&self, unit: &Unit, build: Build) -> Result<PathBuf> {
        let dir = self.cache.join(format!(
            "{}-{}-{}",
            unit.name,
            build.name(),
            self.key(unit, build)
        ));
        let so = dir.join("kernel.so");
        if so.is_file() {
            return Ok(so);
        }
        let io = |what: &str, p: &Path, e: std::io::Error| Error::HostCompiler {
            compiler: self.cxx.clone(),
            reason: format!("{what} {}: {e}", p.display()),
        };
        let tmp = self.cache.join(format!(
            ".tmp-{}-{}-{}",
            unit.name,
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&tmp).map_err(|e| io("creating", &tmp, e))?;
        for (name, text) in unit.files() {
            let p = tmp.join(name);
            std::fs::write(&p, text).map_err(|e| io("writing", &p, e))?;
        }
        let main = tmp.join("main.cpp");
        std::fs::write(&main, &unit.main).map_err(|e| io("writing", &main, e))?;
        let out = tmp.join("kernel.so");
        let mut cmd = Command::new(&self.cxx);
        // A sanitized test process preloads the ASan runtime; the compiler must not
        // inherit it.
        cmd.env_remove("LD_PRELOAD");
        cmd.args(BASE_FLAGS).args(build.flags());
        // The ABI's numbers, as NVRTC gets them (`Variant::nvrtc_options`).
        cmd.args(arfuse_abi::kernel_defines().iter().map(|d| d.option()));
        for (k, v) in &unit.defines {
            cmd.arg(format!("-D{k}={v}"));
        }
        cmd.arg("-I").arg(&tmp).arg(&main).arg("-o").arg(&out);
        let res = cmd.output().map_err(|e| Error::HostCompiler {
            compiler: self.cxx.clone(),
            reason: format!("cannot run it: {e}"),
        })?;
        if !res.status.success() {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(Error::HostCompile {
                variant: unit.name.clone(),
                build: build.name().to_string(),
                stderr: String::from_utf8_lossy(&res.stderr).into_owned(),
            });
        }
        std::fs::create_dir_all(&dir).map_err(|e| io("creating", &dir, e))?;
        for (name, text) in unit.files() {
            // The sources next to the object, for reading a report against.
            let _ = std::fs::write(dir.join(name), text);
        }
        let _ = std::fs::write(dir.join("main.cpp"), &unit.main);
        std::fs::rename(&out, &so).map_err(|e| io("renaming into", &so, e))?;
        let _ = std::fs::remove_dir_all(&tmp);
        Ok(so)
    }
}

/// `f` over `items` on up to `threads` threads; results in the order of `items`, the
/// first error (in that order) if any.
fn par_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let next = AtomicUsize::new(0);
    let threads = threads.clamp(1, 64).min(items.len().max(1));
    let mut results: Vec<(usize, Result<R>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        out.push((i, f(item)));
                    }
                    out
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| {
                w.join().unwrap_or_else(|_| {
                    vec![(
                        0,
                        Err(Error::HostKernel {
                            variant: "(compile thread)".into(),
                            msg: "a compile thread panicked".into(),
                        }),
                    )]
                })
            })
            .collect()
    });
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::KernelParams;
    use crate::host::launch::LaunchOptions;

    /// Small kernels that exercise the executor (not arfuse kernels): one entry point
    /// each, selected by `ARF_TEST_ENTRY`.
    const EXEC_TEST: &str = r#"
#include "arfuse_common.cuh"
// out[(cta * n + tid) * 3 + k]: k = 0 block sum of cta * 1000 + tid (arf_block_sum),
// 1 the value of lane tid ^ 5, 2 what thread 0 of this CTA wrote to shared memory.
extern "C" __global__ void t_sum(const ArfParams p) {
  __shared__ float red[32];
  __shared__ unsigned owner;
  if (threadIdx.x == 0) owner = blockIdx.x;
  __syncthreads();
  const float v = arf_block_sum((float)(blockIdx.x * 1000 + threadIdx.x), red);
  float* out = reinterpret_cast<float*>(p.x.ptr) + (blockIdx.x * blockDim.x + threadIdx.x) * 3;
  out[0] = v;
  out[1] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 5);
  out[2] = (float)owner;
}
extern "C" __global__ void t_divergent(const ArfParams p) {
  if (threadIdx.x < 32)
    __syncthreads();
  else
    __syncthreads();
}
extern "C" __global__ void t_exit(const ArfParams p) {
  if (threadIdx.x == 5) return;
  __syncthreads();
}
extern "C" __global__ void t_partial_warp(const ArfParams p) {
  if (threadIdx.x == 0) return;
  volatile float v = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
  (void)v;
}
"#;

    fn exec_kernel(entry: &str) -> HostKernel {
        let dir = std::env::temp_dir().join("arfuse-host-unit-tests");
        let c = Compiler::new(dir).expect("a C++ compiler");
        let unit = Unit {
            name: format!("exec_test_{entry}"),
            source_file: "exec_test.cu",
            source_text: EXEC_TEST.into(),
            defines: vec![("ARF_DTYPE".into(), 0)],
            main: format!("#include \"exec_test.cu\"\nARF_HOST_ENTRY({entry})\n"),
        };
        let so = c.object(&unit, Build::Plain).expect("test kernel builds");
        // Any variant as the label of the errors.
        let label = variants::virtual_allreduce(2, variants::ActDtype::Bf16);
        HostKernel::load(label, Build::Plain, &so).expect("loads")
    }

    fn launch(k: &HostKernel, out: &mut [f32], grid: u32, block: u32, seed: u64) -> Result<()> {
        let mut p = KernelParams::default();
        p.x.ptr = out.as_mut_ptr() as u64;
        assert!(out.len() >= (grid * block * 3) as usize);
        let opts = if seed == 0 {
            LaunchOptions::default()
        } else {
            LaunchOptions::skewed(seed, std::time::Duration::from_micros(100))
        };
        // SAFETY: the test kernels touch only out[0 .. grid * block * 3].
        unsafe { k.launch(&p, grid, 1, block, &opts) }
    }

    #[test]
    fn shared_memory_is_per_cta_and_shuffles_are_exact() {
        let k = exec_kernel("t_sum");
        for seed in [0, 1, 2] {
            let (grid, block) = (3u32, 128u32);
            let mut out = vec![-1.0f32; (grid * block * 3) as usize];
            launch(&k, &mut out, grid, block, seed).unwrap();
            for b in 0..grid {
                let sum: u32 = (0..block).map(|t| b * 1000 + t).sum();
                for t in 0..block {
                    let o = &out[((b * block + t) * 3) as usize..][..3];
                    assert_eq!(o[0], sum as f32, "block sum, CTA {b} thread {t}");
                    assert_eq!(o[1], (t ^ 5) as f32, "shuffle, CTA {b} thread {t}");
                    assert_eq!(o[2], b as f32, "__shared__ of CTA {b}");
                }
            }
        }
    }

    #[test]
    fn undefined_synchronisation_is_an_error_not_a_hang() {
        let mut out = vec![0.0f32; 3 * 128];
        for (entry, want) in [
            ("t_divergent", "divergent __syncthreads"),
            ("t_exit", "exited"),
            ("t_partial_warp", "lane 0 exited"),
        ] {
            let k = exec_kernel(entry);
            for seed in [0, 7] {
                let e = launch(&k, &mut out, 1, 128, seed).unwrap_err().to_string();
                println!("{entry} seed {seed}: {e}");
                // With some orders the exiting thread leaves the others waiting: then
                // it is a deadlock with no thread able to run.
                assert!(e.contains(want) || e.contains("deadlock"), "{entry}: {e}");
                assert!(e.contains("CTA (0, 0)"), "{entry}: {e}");
            }
        }
    }
}
