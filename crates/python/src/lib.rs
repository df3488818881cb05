//! The extension module `arfuse._arfuse` of the Python package `arfuse`: thin PyO3
//! bindings over the facade crate `arfuse` (policy, import, lowering, splice) and the
//! reference contract (the CPU kernels of `arfuse.torch`). The Python package
//! (`python/arfuse`) wraps it; its public API is documented there and in the stubs
//! (`_arfuse.pyi`).
//!
//! Errors are raised as `arfuse.LoadError`, `arfuse.TargetError` and
//! `arfuse.LowerError` (subclasses of `arfuse.ArfuseError`) carrying the node, tensor or
//! field they name as attributes (`errors`).

mod errors;
mod kernel;
mod lowering;
mod target;

use pyo3::prelude::*;

/// mimalloc for this module's own (Rust) allocations, as in every arfuse binary: a
/// lowering makes about 150 small allocations per site (mostly egg's e-classes),
/// which glibc's malloc serves about a third slower
/// (`crates/rewrite/benches/lower.rs` measures both). Python's objects keep Python's
/// allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[pymodule]
fn _arfuse(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("CONTRACT_NAME", arfuse::reference::CONTRACT_NAME)?;
    m.add(
        "QUANT_FP8_PER_TOKEN_OP",
        arfuse::import::torch_export::ARFUSE_QUANT_FP8_PER_TOKEN,
    )?;
    m.add("ArfuseError", py.get_type::<errors::ArfuseError>())?;
    m.add("LoadError", py.get_type::<errors::LoadError>())?;
    m.add("TargetError", py.get_type::<errors::TargetError>())?;
    m.add("LowerError", py.get_type::<errors::LowerError>())?;
    m.add_class::<target::PyTarget>()?;
    m.add_class::<target::PyPlan>()?;
    m.add_class::<target::PyDispatchRange>()?;
    m.add_function(wrap_pyfunction!(target::plan, m)?)?;
    m.add_function(wrap_pyfunction!(lowering::_lower, m)?)?;
    m.add_function(wrap_pyfunction!(lowering::_fx_lower, m)?)?;
    m.add_function(wrap_pyfunction!(lowering::_fx_lower_walked, m)?)?;
    m.add_function(wrap_pyfunction!(lowering::_fx_walked_json, m)?)?;
    m.add_function(wrap_pyfunction!(kernel::_fused_allreduce_rms_norm_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernel::_quant_fp8_per_token_cpu, m)?)?;
    Ok(())
}
