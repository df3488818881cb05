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
mod ranks;
mod target;
mod walk;

use pyo3::prelude::*;

// No global allocator of its own (arfuse's binaries use mimalloc): the pass runs once
// per compiled graph, and a first call with mimalloc paid for faulting in its fresh
// pages: import + lower + splice of the 32-layer Llama graph took 36-48 ms on a first
// call against 20-22 ms with the system allocator (15-18 ms warm either way).

#[pymodule]
fn _arfuse(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("CONTRACT_NAME", arfuse::advanced::reference::CONTRACT_NAME)?;
    m.add(
        "QUANT_FP8_PER_TOKEN_OP",
        arfuse::advanced::import::torch_export::ARFUSE_QUANT_FP8_PER_TOKEN,
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
    m.add_function(wrap_pyfunction!(lowering::_fx_lower_graph, m)?)?;
    m.add_function(wrap_pyfunction!(lowering::_fx_graph_json, m)?)?;
    m.add_function(wrap_pyfunction!(kernel::_fused_allreduce_rms_norm_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(kernel::_quant_cpu, m)?)?;
    m.add_class::<ranks::HostRanks>()?;
    m.add_class::<ranks::CudaRanks>()?;
    m.add("CALL_TOKENS", ranks::CALL_TOKENS)?;
    m.add("OP_QUANTS", ranks::op_quant_names())?;
    m.add("SCALE_INPUT_QUANTS", ranks::scale_input_quant_names())?;
    {
        use arfuse::advanced::abi;
        m.add("FP8_GROUP_SIZE", abi::FP8_GROUP_SIZE)?;
        m.add("NVFP4_BLOCK", abi::NVFP4_BLOCK)?;
        m.add("NVFP4_TILE_ROWS", abi::NVFP4_TILE_ROWS)?;
        m.add("NVFP4_TILE_COLS", abi::NVFP4_TILE_COLS)?;
    }
    Ok(())
}
