//! Errors of the runtime. Every GPU entry point returns one of these instead of
//! panicking, in particular when no CUDA driver or no NVRTC library is present.

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in `arfuse-runtime`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No NVRTC shared library could be loaded. `searched` lists what was tried.
    #[error("NVRTC library not found (searched: {searched}); run .ci/install-cuda-wheels.sh or set ARFUSE_NVRTC_PATH to libnvrtc.so")]
    NvrtcMissing {
        /// Paths and names that were tried, `; `-separated.
        searched: String,
    },
    /// The NVRTC library was found but lacks a required symbol.
    #[error("NVRTC library {path} lacks symbol {symbol}")]
    NvrtcSymbol {
        /// Path of the library.
        path: String,
        /// Missing symbol.
        symbol: String,
    },
    /// NVRTC refused to compile a kernel variant; `log` is the program log.
    #[error("NVRTC failed to compile variant {variant} for {arch}: {code}\n{log}")]
    Compile {
        /// Variant name (see [`crate::variants::Variant::name`]).
        variant: String,
        /// Target architecture, e.g. `sm_90a`.
        arch: String,
        /// NVRTC result code name.
        code: String,
        /// Compiler log.
        log: String,
    },
    /// No CUDA driver (`libcuda.so`) could be loaded.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {call}: {msg}")]
    Driver {
        /// What was being done.
        call: String,
        /// Driver message.
        msg: String,
    },
    /// The requested configuration is not supported (with the reason).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// An argument is invalid (shape, size, world size, ...).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// Byte arithmetic overflowed (sizes are checked, never wrapped).
    #[error("size overflow computing {0}")]
    Overflow(&'static str),
    /// A call would allocate or create a workspace while a stream is capturing.
    #[error("refused while a CUDA graph capture is in progress: {0}")]
    Capturing(String),
    /// Workspace creation failed before for this key; not retried.
    #[error("workspace creation for {backend} failed earlier (cached, not retried): {reason}")]
    CachedFailure {
        /// Backend that failed.
        backend: String,
        /// The original failure.
        reason: String,
    },
    /// Every backend of the fallback chain failed.
    #[error("no backend available: {0}")]
    NoBackend(String),
    /// A kernel hit its polling timeout (a protocol desynchronisation); it exited
    /// instead of hanging and wrote this code.
    #[error("kernel protocol timeout (error word {0:#x})")]
    KernelTimeout(u32),
    /// The host protocol model timed out (a rank waited too long: a protocol bug).
    #[error("protocol model: {0}")]
    Model(String),
    /// The host C++ compiler (`CXX`, else `g++`) cannot be run.
    #[error("host C++ compiler {compiler} is unusable: {reason}")]
    HostCompiler {
        /// The compiler command.
        compiler: String,
        /// Why (not found, `--version` failed, ...).
        reason: String,
    },
    /// The host C++ compiler rejected a kernel variant; `stderr` is its output.
    #[error("host build ({build}) of variant {variant} failed:\n{stderr}")]
    HostCompile {
        /// Variant name (see [`crate::variants::Variant::name`]).
        variant: String,
        /// Which host build (`plain`, `sanitized`).
        build: String,
        /// The compiler's standard error.
        stderr: String,
    },
    /// A host-compiled kernel could not be loaded or run (executor error: a divergent
    /// or deadlocked `__syncthreads`, a partial-warp shuffle, a bad launch shape, ...).
    #[error("host kernel {variant}: {msg}")]
    HostKernel {
        /// Variant name.
        variant: String,
        /// What went wrong.
        msg: String,
    },
    /// A collective of the process group failed: a peer is gone or did not answer in
    /// time, or sent something malformed.
    #[error("process group: {0}")]
    Group(String),
    /// A collective step (workspace creation, reset) failed on `rank`; every rank of
    /// the group returns this same error.
    #[error("rank {rank} failed in {step}: {cause}")]
    RankFailed {
        /// The lowest rank that failed.
        rank: u32,
        /// The step (`backend vote`, `allocation`, `mapping`, ...).
        step: String,
        /// What that rank reported.
        cause: String,
    },
    /// A fused call on real ranks failed: the error word of this rank (and, when a peer
    /// aborted the call, which rank did and why).
    #[error("fused call {call} failed on rank {rank}: {what} (error word {word:#x}){peer}")]
    CallFailed {
        /// This process's rank.
        rank: u32,
        /// The call's sequence number on this workspace.
        call: u64,
        /// The error word.
        word: u32,
        /// The error word in words (`arfuse_abi::protocol::describe_error_word`).
        what: String,
        /// `; rank q gave up first: ...` when the abort word names a peer, else empty.
        peer: String,
    },
    /// An error while running one fused node of a graph.
    #[error("node {node}: {source}")]
    Node {
        /// The IR node id.
        node: String,
        /// What went wrong.
        #[source]
        source: Box<Error>,
    },
}

impl Error {
    /// This error attributed to IR node `node` (unchanged when it already names it).
    pub fn in_node(self, node: &str) -> Error {
        match self {
            Error::Node { .. } => self,
            Error::Invalid(ref m) | Error::Unsupported(ref m)
                if m.starts_with(&format!("node {node}:")) =>
            {
                self
            }
            other => Error::Node {
                node: node.to_string(),
                source: Box::new(other),
            },
        }
    }
}
