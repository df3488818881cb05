//! Shared helpers of the importer's tests: fixture paths and a builder of small
//! ExportedProgram documents.

#![allow(dead_code)]

use serde_json::{json, Value};

/// The three exports of `ir-fixtures/exported/` (file stems).
pub const EXPORTS: [&str; 3] = [
    "llama31_8b_L2_tp8",
    "qwen3_30b_a3b_L2_tp4",
    "gemma3_1b_L2_tp2",
];

/// The bytes of one export.
pub fn export_bytes(stem: &str) -> Vec<u8> {
    let p = format!(
        "{}/../../ir-fixtures/exported/{stem}.exported_program.json",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

/// A tensor argument.
pub fn t(name: &str) -> Value {
    json!({ "as_tensor": { "name": name } })
}

/// A named argument.
pub fn arg(name: &str, a: Value) -> Value {
    json!({ "name": name, "arg": a, "kind": 1 })
}

/// Tensor metadata: dtype code and sizes (numbers, or strings taken as expressions).
pub fn meta(dtype: i64, sizes: &[Value]) -> Value {
    let sizes: Vec<Value> = sizes
        .iter()
        .map(|s| match s {
            Value::String(e) => json!({ "as_expr": { "expr_str": e, "hint": { "as_int": 4 } } }),
            n => json!({ "as_int": n }),
        })
        .collect();
    json!({ "dtype": dtype, "sizes": sizes, "requires_grad": false,
            "device": { "type": "meta", "index": null }, "layout": 7 })
}

/// A node with one tensor output named `name`.
pub fn node(name: &str, target: &str, args: Vec<Value>, module: &str) -> Value {
    json!({
        "target": format!("torch.ops.{target}"),
        "inputs": args,
        "outputs": [ { "as_tensor": { "name": name } } ],
        "metadata": {
            "nn_module_stack": format!("L__self__,,__main__.Wrap;L__self__{module},{module},torch.nn.Module")
        },
        "name": name
    })
}

/// A small program: user input `x` (bf16 `[s0, 8]`), parameter `w` (bf16 `[8]`, named
/// `m.layer.norm.weight`), parameter `lw` (bf16 `[4, 8]`) and bias `lb` (bf16 `[4]`),
/// then `nodes`; `tensors` adds metadata for the nodes' outputs; `outputs` are
/// returned.
pub fn program(nodes: Vec<Value>, tensors: Vec<(&str, Value)>, outputs: &[&str]) -> Value {
    let mut tv = serde_json::Map::new();
    tv.insert("x".into(), meta(13, &[json!("s0"), json!(8)]));
    tv.insert("w".into(), meta(13, &[json!(8)]));
    tv.insert("lw".into(), meta(13, &[json!(4), json!(8)]));
    tv.insert("lb".into(), meta(13, &[json!(4)]));
    for (k, v) in tensors {
        tv.insert(k.into(), v);
    }
    let outs: Vec<Value> = outputs.iter().map(|o| t(o)).collect();
    json!({
        "graph_module": {
            "graph": {
                "inputs": [t("w"), t("lw"), t("lb"), t("x")],
                "outputs": outs,
                "nodes": nodes,
                "tensor_values": tv,
                "sym_int_values": {},
                "sym_bool_values": {},
                "is_single_tensor_return": false
            },
            "signature": {
                "input_specs": [
                    { "parameter": { "arg": { "name": "w" }, "parameter_name": "m.layer.norm.weight" } },
                    { "parameter": { "arg": { "name": "lw" }, "parameter_name": "m.layer.proj.weight" } },
                    { "parameter": { "arg": { "name": "lb" }, "parameter_name": "m.layer.proj.bias" } },
                    { "user_input": { "arg": { "as_tensor": { "name": "x" } } } }
                ],
                "output_specs": []
            },
            "module_call_graph": [],
            "metadata": {}
        },
        "opset_version": { "aten": 10 },
        "range_constraints": { "s0": { "min_val": 2, "max_val": 4096 } },
        "schema_version": { "major": 8, "minor": 20 },
        "verifiers": ["TRAINING"],
        "torch_version": "test"
    })
}

/// The program as bytes.
pub fn bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec_pretty(v).expect("serializable")
}
