//! # arfuse-abi
//!
//! What arfuse's kernels (`kernels/*.cu`, `*.cuh`) can run, defined once: the enums
//! their variants are selected by (activation dtype, quant epilogue and its scale
//! layouts, strategy, backend), every limit they are built for (world sizes, vectors
//! per thread, row bytes, block threads, the FP8 group and NVFP4 block sizes, the
//! Lamport buffer count and the state block), and the `-D` defines that hand those
//! numbers to the kernel sources ([`kernel_defines`]), so that the `.cuh` files hold no
//! second copy of any of them.
//!
//! The planner (`arfuse-policy`) plans only what this ABI runs ([`world_unsupported`],
//! [`row_unsupported`], [`Quant::unsupported`]: a W, row or epilogue outside it is
//! unfused, with the sentence these functions return as the reason), the IR and the
//! rewrite spell their quant kinds and dtypes with these types, and the runtime
//! compiles its variants (NVRTC and the host C++ compiler) with these defines and
//! checks every fused node with these same functions.
//!
//! No dependency: the `serde` feature adds `Serialize` / `Deserialize` to the enums for
//! the crates that read and write them (TOML targets, the IR's JSON).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod defines;
mod dtype;
mod limits;
pub mod protocol;
mod quant;
mod strategy;

pub use defines::{kernel_defines, KernelDefine};
pub use dtype::ActDtype;
pub use limits::{
    row_bytes, row_shape_unsupported, row_unsupported, world_unsupported, BUFFER_ALIGN_BYTES,
    FP8_GROUP_SIZE, LAMPORT_BUFFER_COUNT, MAX_BLOCK_THREADS, MAX_RANKS, MAX_ROW_BYTES,
    MAX_VECTORS_PER_THREAD, MIN_BLOCK_THREADS, MIN_ROW_BYTES, NVFP4_BLOCK, NVFP4_TILE_COLS,
    NVFP4_TILE_ROWS, STATE_BYTES, VECTOR_BYTES, WARP_THREADS, WORLD_SIZES,
};
pub use quant::{GroupScaleLayout, Nvfp4ScaleLayout, Quant};
pub use strategy::{Backend, Strategy};
