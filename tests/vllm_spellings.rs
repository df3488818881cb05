//! vLLM's spellings of the chain (vLLM 0.32's op schemas: `csrc/torch_bindings.cpp`,
//! `vllm/ir/ops/layernorm.py`, `vllm/distributed/parallel_state.py`), in the compact FX
//! form a torch.compile pass hands the importer: each imported, lowered for W = 2 and
//! checked bit for bit against the original by the reference evaluator on two simulated
//! ranks, or left unfused with the reason in the notes.
//!
//! - vLLM's CPU graph: `auto_functionalized(_C.shm_allreduce, handle, data)` (named as a
//!   sum all-reduce over `tp:0`, as `arfuse.vllm` does) and the decomposed native norms,
//!   the residual added in f32 and normalised unrounded;
//! - vLLM's CUDA graph: `vllm.all_reduce(tensor, group_name)`, `vllm_ir.rms_norm` and
//!   `vllm_ir.fused_add_rms_norm`, `_C.*` norms and quant ops under
//!   `auto_functionalized`.

use arfuse::advanced::import::torch_export::fx::{self, FxGraph};
use arfuse::advanced::import::{CustomAllReduce, ImportOptions};
use arfuse::advanced::ir::{FusedQuant, NormInput, NormRounding, Op};
use arfuse::advanced::reference::check_equivalent;
use arfuse::Target;
use serde_json::{json, Value};

const H: i64 = 256;
const BF16: i64 = 13;
const F32: i64 = 7;
const FP8: i64 = 29;

fn out(name: &str, dtype: i64, sizes: Value) -> Value {
    json!({ "name": name, "dtype": dtype, "sizes": sizes })
}

fn t(name: &str) -> Value {
    json!({ "kind": "tensor", "value": name })
}

fn s(v: &str) -> Value {
    json!({ "kind": "str", "value": v })
}

fn f(v: f64) -> Value {
    json!({ "kind": "float", "value": v })
}

fn none() -> Value {
    json!({ "kind": "none", "value": null })
}

/// A node with tensor outputs `outs` (name, dtype) of shape [s0, H] unless given.
fn node(name: &str, target: &str, args: &[(&str, Value)], outs: Vec<Value>, other: usize) -> Value {
    let args: Vec<Value> = args.iter().map(|(n, a)| json!([n, a])).collect();
    json!({ "name": name, "target": target, "args": args, "outputs": outs, "other_outputs": other, "module": null })
}

/// A `[s0, H]` tensor.
fn act_out(name: &str, dtype: i64) -> Value {
    out(name, dtype, json!(["s0", H]))
}

fn col_out(name: &str) -> Value {
    out(name, F32, json!(["s0", 1]))
}

/// A graph with inputs x, res (bf16 [s0, H]), w (bf16 [H]), scale (f32 [1]), the nodes
/// and outputs.
fn graph(nodes: Vec<Value>, outputs: &[&str]) -> FxGraph {
    let doc = json!({
        "inputs": [
            act_out("x", BF16), act_out("res", BF16),
            out("w", BF16, json!([H])), out("scale", F32, json!([1]))
        ],
        "nodes": nodes,
        "outputs": outputs,
        "symbols": [{ "name": "s0", "min": 1, "max": 64 }],
        "torch_version": null
    });
    serde_json::from_value(doc).unwrap()
}

fn options() -> ImportOptions {
    ImportOptions::default()
        .with_all_reduce_op(CustomAllReduce::new("vllm.all_reduce"))
        .with_all_reduce_op("_C.shm_allreduce=tp:0".parse().unwrap())
}

fn target() -> Target {
    let mut t = Target::preset("h200-sxm-x2").unwrap();
    t.max_batched_tokens = 64;
    t.capture_sizes = vec![1, 2, 4, 8, 16, 32, 64];
    t
}

/// Imports and lowers `g` for the group `tp:0`; the one fused node's attributes, after
/// checking the lowered graph bit for bit against the original.
fn fused_exactly(g: &FxGraph, opts: &ImportOptions) -> arfuse::advanced::ir::FusedAllReduceNorm {
    let imported = fx::import(g, opts).unwrap_or_else(|e| panic!("{e}"));
    let mut lo = arfuse::LowerOptions::default();
    lo.group = Some("tp:0".into());
    let l = arfuse::lower_with(&imported.graph, &target(), &lo).unwrap();
    assert_eq!(
        l.report.all_reduces_fused, 1,
        "{}\n{:?}",
        l.report, imported.notes
    );
    let fused: Vec<_> = l
        .graph
        .nodes()
        .filter_map(|(_, n)| match &n.op {
            Op::FusedAllreduceNorm(f) => Some((**f).clone()),
            _ => None,
        })
        .collect();
    assert_eq!(fused.len(), 1);
    let eq = check_equivalent(&imported.graph, &l.graph, 2, &[1, 3, 8], 5).unwrap();
    assert!(eq.is_bit_exact(), "{eq}");
    fused[0].clone()
}

fn vllm_all_reduce() -> Value {
    node(
        "ar",
        "vllm.all_reduce.default",
        &[("tensor", t("x")), ("group_name", s("tp:0"))],
        vec![act_out("ar", BF16)],
        0,
    )
}

fn fused_add(name: &str, target: &str, eps_name: &str) -> Value {
    node(
        name,
        target,
        &[
            ("x", t("ar")),
            ("x_residual", t("res")),
            ("weight", t("w")),
            (eps_name, f(1e-5)),
            ("variance_size", none()),
        ],
        vec![act_out("norm", BF16), act_out("h", BF16)],
        0,
    )
}

#[test]
fn vllm_ir_fused_add_rms_norm_fuses_with_its_native_rounding() {
    let g = graph(
        vec![
            vllm_all_reduce(),
            fused_add("fan", "vllm_ir.fused_add_rms_norm.default", "epsilon"),
        ],
        &["norm", "h"],
    );
    let f = fused_exactly(&g, &options());
    assert_eq!(f.group, "tp:0");
    assert!(f.residual);
    assert_eq!(f.norm_input, NormInput::F32Sum);
    assert_eq!(f.norm_rounding, NormRounding::Twice);
    assert_eq!(f.eps, 1e-5);
}

#[test]
fn vllm_ir_rms_norm_after_the_embedding_all_reduce_fuses_without_residual() {
    let g = graph(
        vec![
            vllm_all_reduce(),
            node(
                "norm",
                "vllm_ir.rms_norm.default",
                &[
                    ("x", t("ar")),
                    ("weight", t("w")),
                    ("epsilon", f(1e-6)),
                    ("variance_size", none()),
                ],
                vec![act_out("norm", BF16)],
                0,
            ),
        ],
        &["norm", "ar"],
    );
    let f = fused_exactly(&g, &options());
    assert!(!f.residual);
    assert_eq!(f.norm_rounding, NormRounding::Twice);
    assert_eq!(f.norm_input, NormInput::Residual);
}

/// `auto_functionalized(op, **kwargs)`: its tensor outputs are the written arguments.
fn af(name: &str, op: &str, args: &[(&str, Value)], outs: Vec<Value>) -> Value {
    let mut all = vec![("_op", s(op))];
    all.extend(args.iter().cloned());
    node(name, "higher_order.auto_functionalized", &all, outs, 1)
}

fn cpu_graph() -> FxGraph {
    // vLLM's CPU graph (vllm_ir.fused_add_rms_norm traced through its native code).
    let n = |name: &str, target: &str, args: &[(&str, Value)], o: Value| {
        node(name, target, args, vec![o], 0)
    };
    let cast = |name: &str, of: &str, dtype: i64| {
        n(
            name,
            "prims.convert_element_type.default",
            &[
                ("a", t(of)),
                ("dtype", json!({ "kind": "dtype", "value": dtype })),
            ],
            act_out(name, dtype),
        )
    };
    graph(
        vec![
            af(
                "af",
                "_C.shm_allreduce.default",
                &[
                    ("handle", json!({ "kind": "int", "value": 0 })),
                    ("data", t("x")),
                ],
                vec![act_out("getitem", BF16)],
            ),
            cast("xf", "getitem", F32),
            cast("rf", "res", F32),
            n(
                "hs",
                "aten.add.Tensor",
                &[("self", t("xf")), ("other", t("rf"))],
                act_out("hs", F32),
            ),
            cast("h", "hs", BF16),
            n(
                "p",
                "aten.pow.Tensor_Scalar",
                &[
                    ("self", t("hs")),
                    ("exponent", json!({ "kind": "int", "value": 2 })),
                ],
                act_out("p", F32),
            ),
            n(
                "ms",
                "aten.mean.dim",
                &[
                    ("self", t("p")),
                    ("dim", json!({ "kind": "ints", "value": [-1] })),
                    ("keepdim", json!({ "kind": "bool", "value": true })),
                ],
                col_out("ms"),
            ),
            n(
                "ve",
                "aten.add.Tensor",
                &[("self", t("ms")), ("other", f(1e-5))],
                col_out("ve"),
            ),
            n(
                "r",
                "aten.rsqrt.default",
                &[("self", t("ve"))],
                col_out("r"),
            ),
            n(
                "nf",
                "aten.mul.Tensor",
                &[("self", t("hs")), ("other", t("r"))],
                act_out("nf", F32),
            ),
            cast("nb", "nf", BF16),
            n(
                "norm",
                "aten.mul.Tensor",
                &[("self", t("nb")), ("other", t("w"))],
                act_out("norm", BF16),
            ),
        ],
        &["norm", "h"],
    )
}

#[test]
fn vllm_cpu_shm_all_reduce_and_native_norm_fuse_normalising_the_f32_sum() {
    let f = fused_exactly(&cpu_graph(), &options());
    assert!(f.residual);
    assert_eq!(f.norm_input, NormInput::F32Sum);
    assert_eq!(f.norm_rounding, NormRounding::Twice);
}

#[test]
fn shm_all_reduce_not_named_is_warned_about_and_left_alone() {
    let imported = fx::import(&cpu_graph(), &ImportOptions::default()).unwrap();
    assert!(
        imported.notes.iter().any(|n| n.starts_with(
            "warning: higher_order.auto_functionalized(_C.shm_allreduce.default): looks like a collective"
        )),
        "{:?}",
        imported.notes
    );
    let l = arfuse::lower(&imported.graph, &target()).unwrap();
    assert_eq!(l.report.all_reduces_seen, 0);
}

fn c_fused_add() -> Value {
    af(
        "fa",
        "_C.fused_add_rms_norm.default",
        &[
            ("input", t("ar")),
            ("residual", t("res")),
            ("weight", t("w")),
            ("epsilon", f(1e-6)),
        ],
        vec![act_out("norm", BF16), act_out("h", BF16)],
    )
}

#[test]
fn c_fused_add_rms_norm_fuses_rounding_the_residual_once_unless_kept_opaque() {
    let g = graph(vec![vllm_all_reduce(), c_fused_add()], &["norm", "h"]);
    let f = fused_exactly(&g, &options());
    assert_eq!(f.norm_input, NormInput::Residual);
    assert_eq!(f.norm_rounding, NormRounding::Once);
    // vLLM's CPU kernel computes neither form: arfuse.vllm keeps it opaque on the CPU.
    let opts = options().with_opaque_op("_C.fused_add_rms_norm", "vLLM's CPU kernel");
    let imported = fx::import(&g, &opts).unwrap();
    assert!(imported
        .notes
        .iter()
        .any(|n| n == "kept 1 higher_order.auto_functionalized(_C.fused_add_rms_norm.default) opaque: vLLM's CPU kernel"),
        "{:?}", imported.notes);
}

fn with_quant(op: &str, args: &[(&str, Value)], outs: Vec<Value>) -> FxGraph {
    let mut all = vec![("input", t("norm"))];
    all.extend(args.iter().cloned());
    graph(
        vec![
            vllm_all_reduce(),
            c_fused_add(),
            af("q", op, &all, outs.clone()),
        ],
        &outs
            .iter()
            .map(|o| o["name"].as_str().unwrap())
            .chain(["h"])
            .collect::<Vec<_>>(),
    )
}

#[test]
fn c_static_and_per_token_fp8_quants_fuse() {
    let g = with_quant(
        "_C.static_scaled_fp8_quant.default",
        &[
            ("result", t("x")),
            ("scale", t("scale")),
            ("group_shape", none()),
        ],
        vec![act_out("q", FP8)],
    );
    assert_eq!(fused_exactly(&g, &options()).quant, FusedQuant::Fp8Static);
    let g = with_quant(
        "_C.dynamic_per_token_scaled_fp8_quant.default",
        &[
            ("result", t("x")),
            ("scale", t("scale")),
            ("scale_ub", none()),
        ],
        vec![act_out("q", FP8), col_out("qs")],
    );
    assert_eq!(fused_exactly(&g, &options()).quant, FusedQuant::Fp8PerToken);
}

#[test]
fn quants_vllm_computes_otherwise_stay_opaque_with_the_reason() {
    let cases = [
        (
            "_C.dynamic_per_token_scaled_fp8_quant.default",
            vec![
                ("result", t("x")),
                ("scale", t("scale")),
                ("scale_ub", t("scale")),
            ],
            "scale_ub is set",
        ),
        (
            "_C.per_token_group_fp8_quant.default",
            vec![("output_q", t("x")), ("output_s", t("scale"))],
            "from the scale tensor's strides",
        ),
        (
            "_C.scaled_fp4_quant.default",
            vec![
                ("output", t("x")),
                ("output_scale", t("scale")),
                ("input_scale", t("scale")),
            ],
            "rcp.approx",
        ),
    ];
    for (op, args, why) in cases {
        let g = with_quant(op, &args, vec![act_out("q", FP8), col_out("qs")]);
        let imported = fx::import(&g, &options()).unwrap();
        assert!(
            imported
                .notes
                .iter()
                .any(|n| n.contains(&format!("({op}) opaque")) && n.contains(why)),
            "{op}: {:?}",
            imported.notes
        );
        // The norm still fuses, its quant left as it is.
        let mut lo = arfuse::LowerOptions::default();
        lo.group = Some("tp:0".into());
        let l = arfuse::lower_with(&imported.graph, &target(), &lo).unwrap();
        assert_eq!(l.report.all_reduces_fused, 1, "{op}: {}", l.report);
    }
}

#[test]
fn vllm_norms_that_are_not_fused_norms_say_why() {
    for (args, why) in [
        (
            vec![("variance_size", json!({ "kind": "int", "value": 128 }))],
            "variance_size is set",
        ),
        (vec![("weight", none())], "no weight"),
    ] {
        let mut base: Vec<(&str, Value)> = vec![
            ("x", t("ar")),
            ("x_residual", t("res")),
            ("weight", t("w")),
            ("epsilon", f(1e-5)),
            ("variance_size", none()),
        ];
        for (k, v) in &args {
            for b in base.iter_mut() {
                if b.0 == *k {
                    b.1 = v.clone();
                }
            }
        }
        let g = graph(
            vec![
                vllm_all_reduce(),
                node(
                    "fan",
                    "vllm_ir.fused_add_rms_norm.default",
                    &base,
                    vec![act_out("norm", BF16), act_out("h", BF16)],
                    0,
                ),
            ],
            &["norm", "h"],
        );
        let imported = fx::import(&g, &options()).unwrap();
        assert!(
            imported.notes.iter().any(|n| n.contains(why)),
            "{why}: {:?}",
            imported.notes
        );
    }
}
