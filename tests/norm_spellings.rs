//! The RMSNorm spellings of real modeling code, as torch.export writes them, end to end:
//! imported (torch's type promotion made explicit), lowered (each fused with the
//! rounding it spells), and checked bit for bit against the original by the reference
//! evaluator on two simulated ranks; spellings no fused epilogue computes are refused
//! with a reason naming the op.

use arfuse::advanced::ir::{NormInput, NormRounding, Op};
use arfuse::advanced::reference::check_equivalent;
use arfuse::{Graph, Target};
use serde_json::{json, Value};

const H: u64 = 256;

fn t(name: &str) -> Value {
    json!({ "as_tensor": { "name": name } })
}

fn node(name: &str, target: &str, args: &[(&str, Value)], module: &str) -> Value {
    let inputs: Vec<Value> = args
        .iter()
        .map(|(n, a)| json!({ "name": n, "arg": a, "kind": 1 }))
        .collect();
    json!({
        "target": format!("torch.ops.{target}"),
        "inputs": inputs,
        "outputs": [{ "as_tensor": { "name": name } }],
        "metadata": { "nn_module_stack": format!("L__self__,,Wrap;L__self__{module},{module},M") },
        "name": name
    })
}

fn meta(dtype: i64, sizes: &[Value]) -> Value {
    let sizes: Vec<Value> = sizes
        .iter()
        .map(|s| match s {
            Value::String(e) => json!({ "as_expr": { "expr_str": e } }),
            n => json!({ "as_int": n }),
        })
        .collect();
    json!({ "dtype": dtype, "sizes": sizes })
}

const BF16: i64 = 13;
const F32: i64 = 7;

fn act(dtype: i64) -> Value {
    meta(dtype, &[json!("s0"), json!(H)])
}

fn col(dtype: i64) -> Value {
    meta(dtype, &[json!("s0"), json!(1)])
}

/// all_reduce(x) + res, then the decomposed norm up to the f32 normalised value `n`,
/// then `tail` (nodes and their output types) ending in `y`. The weight `w` has dtype
/// `wdtype`.
fn program(wdtype: i64, tail: Vec<(Value, Value)>) -> Vec<u8> {
    program_with(wdtype, false, tail)
}

/// [`program`]; with `f32_sum`, the residual add is vLLM's native one
/// (`vllm/ir/ops/layernorm.py`, `fused_add_rms_norm`): `hf = f32(wt) + f32(res)` in f32,
/// `h = hf.to(bf16)` the new residual, and the norm reads the unrounded `hf`.
fn program_with(wdtype: i64, f32_sum: bool, tail: Vec<(Value, Value)>) -> Vec<u8> {
    let norm = "m.layers.0.post_attention_layernorm";
    let mut nodes = vec![
        (
            node(
                "ar",
                "_c10d_functional.all_reduce.default",
                &[
                    ("input", t("x")),
                    ("reduce_op", json!({ "as_string": "sum" })),
                    ("group_name", json!({ "as_string": "0" })),
                ],
                "m.layers.0.self_attn.o_proj",
            ),
            act(BF16),
        ),
        (
            node(
                "wt",
                "_c10d_functional.wait_tensor.default",
                &[("tensor", t("ar"))],
                "m.layers.0.self_attn.o_proj",
            ),
            act(BF16),
        ),
        (
            node(
                "h",
                "aten.add.Tensor",
                &[("self", t("res")), ("other", t("wt"))],
                "m.layers.0",
            ),
            act(BF16),
        ),
        (
            node(
                "hf",
                "aten.to.dtype",
                &[
                    ("self", t("h")),
                    ("dtype", json!({ "as_scalar_type": F32 })),
                ],
                norm,
            ),
            act(F32),
        ),
        (
            node(
                "p",
                "aten.pow.Tensor_Scalar",
                &[("self", t("hf")), ("exponent", json!({ "as_int": 2 }))],
                norm,
            ),
            act(F32),
        ),
        (
            node(
                "ms",
                "aten.mean.dim",
                &[
                    ("self", t("p")),
                    ("dim", json!({ "as_ints": [-1] })),
                    ("keepdim", json!({ "as_bool": true })),
                ],
                norm,
            ),
            col(F32),
        ),
        (
            node(
                "ve",
                "aten.add.Tensor",
                &[("self", t("ms")), ("other", json!({ "as_float": 1e-6 }))],
                norm,
            ),
            col(F32),
        ),
        (
            node("r", "aten.rsqrt.default", &[("self", t("ve"))], norm),
            col(F32),
        ),
        (
            node(
                "n",
                "aten.mul.Tensor",
                &[("self", t("hf")), ("other", t("r"))],
                norm,
            ),
            act(F32),
        ),
    ];
    if f32_sum {
        // Replace `h = res + wt; hf = f32(h)` by vLLM's native head.
        nodes.drain(2..4);
        let head = [
            (cast("xf", "wt", F32), act(F32)),
            (cast("rf", "res", F32), act(F32)),
            (
                node(
                    "hf",
                    "aten.add.Tensor",
                    &[("self", t("xf")), ("other", t("rf"))],
                    norm,
                ),
                act(F32),
            ),
            (cast("h", "hf", BF16), act(BF16)),
        ];
        nodes.splice(2..2, head);
    }
    nodes.extend(tail);
    let mut tv = serde_json::Map::new();
    tv.insert("x".into(), act(BF16));
    tv.insert("res".into(), act(BF16));
    tv.insert("w".into(), meta(wdtype, &[json!(H)]));
    for (n, m) in &nodes {
        tv.insert(n["name"].as_str().unwrap().to_string(), m.clone());
    }
    let doc = json!({
        "graph_module": {
            "graph": {
                "inputs": [t("w"), t("x"), t("res")],
                "outputs": [t("y"), t("h")],
                "nodes": nodes.into_iter().map(|(n, _)| n).collect::<Vec<_>>(),
                "tensor_values": tv,
                "sym_int_values": {}
            },
            "signature": { "input_specs": [
                { "parameter": { "arg": { "name": "w" }, "parameter_name": "m.layers.0.post_attention_layernorm.weight" } },
                { "user_input": { "arg": { "as_tensor": { "name": "x" } } } },
                { "user_input": { "arg": { "as_tensor": { "name": "res" } } } }
            ] }
        },
        "range_constraints": { "s0": { "min_val": 1, "max_val": 64 } },
        "schema_version": { "major": 8, "minor": 20 }
    });
    serde_json::to_vec(&doc).unwrap()
}

fn cast(name: &str, of: &str, dtype: i64) -> Value {
    node(
        name,
        "aten.to.dtype",
        &[
            ("self", t(of)),
            ("dtype", json!({ "as_scalar_type": dtype })),
        ],
        "m.layers.0.post_attention_layernorm",
    )
}

fn mul(name: &str, a: &str, b: &str) -> Value {
    node(
        name,
        "aten.mul.Tensor",
        &[("self", t(a)), ("other", t(b))],
        "m.layers.0.post_attention_layernorm",
    )
}

/// Llama: `self.weight * hidden_states.to(input_dtype)`.
fn llama() -> Vec<u8> {
    program(
        BF16,
        vec![
            (cast("nb", "n", BF16), act(BF16)),
            (mul("y", "w", "nb"), act(BF16)),
        ],
    )
}

/// vLLM's native `fused_add_rms_norm` (its CPU default, and its IR op's native form):
/// the unrounded f32 sum normalised, `x.to(weight.dtype) * weight` (two roundings).
fn vllm_native() -> Vec<u8> {
    program_with(
        BF16,
        true,
        vec![
            (cast("nb", "n", BF16), act(BF16)),
            (mul("y", "nb", "w"), act(BF16)),
        ],
    )
}

/// gpt-oss: `(self.weight * hidden_states).to(input_dtype)`, bf16 times f32.
fn gpt_oss() -> Vec<u8> {
    program(
        BF16,
        vec![
            (mul("y32", "w", "n"), act(F32)),
            (cast("y", "y32", BF16), act(BF16)),
        ],
    )
}

/// Nemotron-H: `(self.weight.to(torch.float32) * hidden_states).to(input_dtype)`.
fn nemotron() -> Vec<u8> {
    program(
        BF16,
        vec![
            (cast("wf", "w", F32), meta(F32, &[json!(H)])),
            (mul("y32", "wf", "n"), act(F32)),
            (cast("y", "y32", BF16), act(BF16)),
        ],
    )
}

/// Gemma: `(x * (1.0 + self.weight.float())).type_as(x)`.
fn gemma() -> Vec<u8> {
    program(
        BF16,
        vec![
            (cast("wf", "w", F32), meta(F32, &[json!(H)])),
            (
                node(
                    "w1",
                    "aten.add.Tensor",
                    &[("self", t("wf")), ("other", json!({ "as_float": 1.0 }))],
                    "m.layers.0.post_attention_layernorm",
                ),
                meta(F32, &[json!(H)]),
            ),
            (mul("y32", "n", "w1"), act(F32)),
            (
                node(
                    "y",
                    "aten.type_as.default",
                    &[("self", t("y32")), ("other", t("h"))],
                    "m.layers.0.post_attention_layernorm",
                ),
                act(BF16),
            ),
        ],
    )
}

fn target() -> Target {
    let mut t = Target::preset("h200-sxm-x8").unwrap();
    t.world_size = 2;
    t
}

fn import(bytes: &[u8]) -> Graph {
    arfuse::advanced::import::load_any(bytes)
        .unwrap_or_else(|e| panic!("{e}"))
        .graph
}

/// Lowers `bytes`, checks the one fused node's rounding and weight bias, and checks the
/// lowered graph bit for bit against the original; returns both graphs.
fn fuses_exactly(bytes: &[u8], rounding: NormRounding, weight_bias: f64) -> (Graph, Graph) {
    let g = import(bytes);
    let l = arfuse::lower(&g, &target()).unwrap();
    assert_eq!(l.report.all_reduces_fused, 1, "{}", l.report);
    let fused: Vec<_> = l
        .graph
        .nodes()
        .filter_map(|(_, n)| match &n.op {
            Op::FusedAllreduceNorm(f) => Some(f.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(fused.len(), 1);
    assert_eq!(fused[0].norm_rounding, rounding);
    assert_eq!(fused[0].weight_bias, weight_bias);
    let want_input = if bytes == vllm_native().as_slice() {
        NormInput::F32Sum
    } else {
        NormInput::Residual
    };
    assert_eq!(fused[0].norm_input, want_input);
    let eq = check_equivalent(&g, &l.graph, 2, &[1, 3, 8], 7).unwrap();
    assert!(eq.is_bit_exact(), "{eq}");
    (g, l.graph)
}

#[test]
fn llama_norm_fuses_rounding_twice_and_once_would_be_caught() {
    let (g, lowered) = fuses_exactly(&llama(), NormRounding::Twice, 0.0);
    // The same node with one rounding is not the graph's norm: the reference sees it.
    let json = lowered.to_json_string();
    let once = json.replace("\"norm_rounding\":\"twice\",", "");
    assert_ne!(once, json, "{json}");
    let lowered = Graph::from_json_str(&once).unwrap();
    let eq = check_equivalent(&g, &lowered, 2, &[1, 3, 8], 7).unwrap();
    assert!(!eq.is_equivalent(), "{eq}");
    assert!(eq
        .failures()
        .iter()
        .all(|(_, o)| o.index == 0 && o.max_ulp == 1));
}

#[test]
fn vllm_native_norm_of_the_f32_sum_fuses_with_norm_input_f32_sum() {
    let (g, lowered) = fuses_exactly(&vllm_native(), NormRounding::Twice, 0.0);
    // The same node normalising the rounded residual is not the graph's norm; the
    // residual output is the same either way.
    let json = lowered.to_json_string();
    let rounded = json.replace("\"norm_input\":\"f32_sum\",", "");
    assert_ne!(rounded, json, "{json}");
    let lowered = Graph::from_json_str(&rounded).unwrap();
    let eq = check_equivalent(&g, &lowered, 2, &[1, 3, 8, 16], 7).unwrap();
    assert!(!eq.is_equivalent(), "{eq}");
    assert!(eq.failures().iter().all(|(_, o)| o.index == 0), "{eq}");
}

#[test]
fn gpt_oss_mixed_dtype_norm_fuses_rounding_once() {
    fuses_exactly(&gpt_oss(), NormRounding::Once, 0.0);
}

#[test]
fn nemotron_f32_weight_norm_fuses_rounding_once() {
    fuses_exactly(&nemotron(), NormRounding::Once, 0.0);
}

#[test]
fn gemma_offset_norm_fuses_rounding_once_with_bias_one() {
    fuses_exactly(&gemma(), NormRounding::Once, 1.0);
}

fn refusal(bytes: &[u8]) -> String {
    let g = import(bytes);
    let l = arfuse::lower(&g, &target()).unwrap();
    assert_eq!(l.report.all_reduces_fused, 0, "{}", l.report);
    l.report.sites[0].reason.clone().unwrap_or_default()
}

#[test]
fn norm_tails_no_fused_epilogue_computes_are_refused_naming_the_op() {
    // Rounded to bf16, widened again and multiplied by an f32 weight, then cast back.
    let widened = program(
        BF16,
        vec![
            (cast("nb", "n", BF16), act(BF16)),
            (cast("wf", "w", F32), meta(F32, &[json!(H)])),
            (mul("y32", "nb", "wf"), act(F32)),
            (cast("y", "y32", BF16), act(BF16)),
        ],
    );
    let why = refusal(&widened);
    assert!(why.contains("the norm at `y` (to_dtype)"), "{why}");
    assert!(
        why.contains("rounds the normalised value to bf16, widens it to f32"),
        "{why}"
    );
    // An f32 weight with bf16 activations and no offset: no kernel form.
    let f32_weight = program(
        F32,
        vec![
            (mul("y32", "w", "n"), act(F32)),
            (cast("y", "y32", BF16), act(BF16)),
        ],
    );
    let why = refusal(&f32_weight);
    assert!(why.contains("the norm at `y` (to_dtype)"), "{why}");
    assert!(why.contains("none of a cast of a bf16 weight"), "{why}");
}
