//! What the host tests share: the compiler cache directory and the case rule of the
//! host matrices.
#![allow(dead_code)] // each test binary uses part of it

use arfuse_runtime::check::Case;
use arfuse_runtime::host::Compiler;
use arfuse_runtime::variants::{ActDtype, Epilogue, Strategy};

/// The host compiler, caching its objects under the test target's tmp dir.
pub fn new_compiler() -> Compiler {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("arfuse-host");
    Compiler::new(dir).expect("a C++ compiler (g++, or CXX)")
}

/// A case of W, dtype, epilogue, strategy and T at `hidden`: the Gemma weight form
/// (offset weight in f32) on the residual-free norms and the Llama order (two
/// roundings) on the residual norms, so both weight forms and both roundings run;
/// except at W = 4 the residual norms normalise the unrounded f32 sum (vLLM's native
/// form), so both norm inputs run too.
pub fn weight_form_case(
    world: u32,
    dtype: ActDtype,
    epilogue: Epilogue,
    strategy: Strategy,
    tokens: u32,
    hidden: u32,
) -> Case {
    let offset = epilogue.norm && !epilogue.residual;
    Case {
        strategy,
        world,
        dtype,
        epilogue,
        tokens,
        hidden,
        weight_bias: u32::from(offset),
        gamma_f32: offset,
        norm_round_twice: epilogue.norm && epilogue.residual,
        norm_f32_sum: epilogue.norm && epilogue.residual && world != 4,
    }
}
