//! The compact FX form (`arfuse_import::torch_export::fx`): the 2-layer Llama fixture
//! imports, tensors arfuse cannot type are opaque-only `u8` scalars (noted, not
//! errors), and the JSON form of an [`FxGraph`] round-trips.

use arfuse_import::torch_export::fx::{
    self, FxArg, FxGraph, FxNode, FxSize, FxSymbol, FxTensor, SymInt,
};
use arfuse_import::ImportOptions;
use arfuse_ir::{DType, Op, ReduceOp, TensorType};
use std::io::Read;

fn fixture(name: &str) -> FxGraph {
    let p = format!(
        "{}/../../ir-fixtures/fx/{name}.fx.json.gz",
        env!("CARGO_MANIFEST_DIR")
    );
    let raw = std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"));
    let mut text = String::new();
    flate2::read::MultiGzDecoder::new(&raw[..])
        .read_to_string(&mut text)
        .unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{p}: {e}"))
}

#[test]
fn two_layer_llama_imports() {
    let fx = fixture("llama_2l_tp2");
    assert_eq!(fx.nodes.len(), 240);
    assert_eq!(fx.inputs.len(), 22);
    let imp = fx::import(&fx, &ImportOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let g = &imp.graph;
    assert_eq!(g.len(), NODES);
    let all_reduces: Vec<_> = g
        .nodes()
        .filter_map(|(_, n)| match &n.op {
            Op::AllReduce { group, reduce } => Some((n.id.as_str(), group.as_str(), *reduce)),
            _ => None,
        })
        .collect();
    assert_eq!(
        all_reduces,
        [
            "all_reduce",
            "all_reduce_1",
            "all_reduce_2",
            "all_reduce_3",
            "all_reduce_4"
        ]
        .map(|id| (id, "0", ReduceOp::Sum))
    );
    // Every FX all-reduce became an IR one: none is left opaque.
    assert!(!imp.opaque_targets.iter().any(|t| t.contains("all_reduce")));
    let bf16_h = |g: &arfuse_ir::Graph, id: &str| {
        let n = g.node(g.find(id).unwrap());
        (
            n.outputs[0].dtype,
            n.outputs[0].shape.to_string(),
            n.module.clone(),
        )
    };
    assert_eq!(
        bf16_h(g, "all_reduce_1"),
        (
            DType::Bf16,
            "[1,s70,256]".to_string(),
            Some("m.model.layers.0.self_attn.o_proj".to_string())
        )
    );
    assert_eq!(imp.notes, NOTES);
    // The tensors map names every FX value the graph kept: a forwarded wait reads as
    // its all-reduce.
    let ar = g.find("all_reduce_1").unwrap();
    assert_eq!(imp.tensors["all_reduce_1"], arfuse_ir::Value::new(ar, 0));
    assert_eq!(imp.tensors["wait_tensor_1"], arfuse_ir::Value::new(ar, 0));
    let md = g.metadata().unwrap();
    assert_eq!(md["schema_version"], "8.fx");
    assert_eq!(md["module_prefix_removed"], "");
}

/// 240 FX nodes and 22 inputs, less 5 waits, a clone and an expand forwarded and a
/// symbolic add skipped, plus the helper casts and constants of the promoted adds and
/// multiplications.
const NODES: usize = 263;
const NOTES: &[&str] = &[
    "forwarded 5 _c10d_functional.wait_tensor.default (identity: users read its input)",
    "forwarded 1 aten.clone.default (identity: users read its input)",
    "forwarded 1 aten.expand.default (identity: users read its input)",
    "skipped 1 _operator.add node(s) computing symbolic sizes only",
    "typed 7 bool tensor(s) as u8 (only opaque ops use them)",
    "kept 3 aten.add.Tensor opaque: a scalar operand with an integer (i64) tensor",
    "kept 5 aten.expand.default opaque: the element count changes (a broadcasting expand)",
    "size expression (s70 + 1) is not a monomial; imported as fresh symbol x0 in 3..=8193",
];

fn tensor(name: &str, dtype: i64, sizes: Vec<FxSize>) -> FxTensor {
    FxTensor {
        name: name.into(),
        dtype,
        sizes,
    }
}

fn opaque_node(name: &str, input: &str, out: FxTensor) -> FxNode {
    FxNode {
        name: name.into(),
        target: "aten.frobnicate.default".into(),
        args: vec![("self".into(), FxArg::Tensor(input.into()))],
        outputs: vec![out],
        other_outputs: 0,
        module: Some("model.layers.0".into()),
    }
}

/// `x` (bf16 `[s0, 8]`) -> opaque `a` (an unknown dtype) -> opaque `b` (a size that
/// does not parse) -> opaque `c` (bf16 `[s0, 8]` again).
fn untypable() -> FxGraph {
    let x = || vec![FxSize::Expr("s0".into()), FxSize::Const(8)];
    FxGraph {
        inputs: vec![tensor("x", 13, x())],
        nodes: vec![
            opaque_node("a", "x", tensor("a", 99, x())),
            opaque_node(
                "b",
                "a",
                tensor(
                    "b",
                    13,
                    vec![FxSize::Expr("s0 +* 2".into()), FxSize::Const(8)],
                ),
            ),
            opaque_node("c", "b", tensor("c", 13, x())),
        ],
        outputs: vec!["c".into()],
        symbols: vec![FxSymbol {
            name: "s0".into(),
            min: Some(1),
            max: Some(4096),
        }],
        torch_version: Some("2.9.0".into()),
    }
}

#[test]
fn untypable_tensors_are_opaque_u8_scalars_not_errors() {
    let imp = fx::import(&untypable(), &ImportOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let g = &imp.graph;
    let ty = |id: &str| g.node(g.find(id).unwrap()).outputs[0].clone();
    let scalar_u8 = TensorType::new(DType::U8, vec![]);
    assert_eq!(ty("a"), scalar_u8);
    assert_eq!(ty("b"), scalar_u8);
    assert_eq!(ty("c").to_string(), "bf16[s0,8]");
    for id in ["a", "b", "c"] {
        match &g.node(g.find(id).unwrap()).op {
            Op::Opaque { target, attrs } => {
                assert_eq!(target, "aten.frobnicate.default");
                assert_eq!(attrs, &serde_json::json!({ "self": { "input": 0 } }));
            }
            op => panic!("{id}: {op:?}"),
        }
    }
    assert_eq!(
        imp.notes,
        [
            "typed 1 tensor(s) with dtype an unknown code (99) (typed as opaque u8 scalars, \
             read only by opaque ops)",
            "typed 1 tensor(s) with sizes arfuse cannot read (typed as opaque u8 scalars, \
             read only by opaque ops)",
        ]
    );
    assert_eq!(g.metadata().unwrap()["torch_version"], "2.9.0");
}

#[test]
fn untypable_tensors_are_errors_in_torch_export_files() {
    // The same graph in torch.export's schema: the unknown dtype is an error there.
    let e = arfuse_import::load_any(
        serde_json::json!({
            "schema_version": { "major": 8, "minor": 0 },
            "graph_module": { "graph": {
                "inputs": [{ "as_tensor": { "name": "x" } }],
                "outputs": [{ "as_tensor": { "name": "a" } }],
                "nodes": [{
                    "target": "torch.ops.aten.frobnicate.default",
                    "inputs": [{ "name": "self", "arg": { "as_tensor": { "name": "x" } } }],
                    "outputs": [{ "as_tensor": { "name": "a" } }],
                    "name": "a"
                }],
                "tensor_values": {
                    "x": { "dtype": 13, "sizes": [{ "as_int": 8 }] },
                    "a": { "dtype": 99, "sizes": [{ "as_int": 8 }] }
                }
            } }
        })
        .to_string()
        .as_bytes(),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "tensor \"a\" has dtype an unknown code (99), which arfuse IR cannot represent"
    );
}

/// One argument of every kind, a non-finite float among them.
fn every_kind() -> Vec<(String, FxArg)> {
    [
        ("tensor", FxArg::Tensor("x".into())),
        (
            "tensors",
            FxArg::tensors(vec![Some("x".into()), Some("x".into())]),
        ),
        ("optional", FxArg::tensors(vec![Some("x".into()), None])),
        ("none", FxArg::None),
        ("int", FxArg::Int(-3)),
        ("float", FxArg::Float(1e-5)),
        ("inf", FxArg::Float(f64::INFINITY)),
        ("neg_inf", FxArg::Float(f64::NEG_INFINITY)),
        ("bool", FxArg::Bool(true)),
        ("str", FxArg::Str("sum".into())),
        ("ints", FxArg::Ints(vec![-1, 2])),
        ("floats", FxArg::Floats(vec![0.5, f64::INFINITY, 2.0])),
        ("bools", FxArg::Bools(vec![true, false])),
        ("sym", FxArg::Sym(SymInt::Expr("2*s0".into()))),
        (
            "syms",
            FxArg::Syms(vec![SymInt::Const(4), SymInt::Expr("s0".into())]),
        ),
        ("dtype", FxArg::Dtype(13)),
        ("other", FxArg::other("list")),
    ]
    .into_iter()
    .map(|(n, a)| (n.to_string(), a))
    .collect()
}

#[test]
fn json_form_round_trips() {
    let mut fx = untypable();
    fx.nodes[0].args = every_kind();
    fx.nodes[0].other_outputs = 1;
    fx.nodes[1].module = None;
    let text = serde_json::to_string(&fx).unwrap();
    let back: FxGraph = serde_json::from_str(&text).unwrap();
    assert_eq!(back, fx);
    // The form the fixtures were written in: kind and value, a non-finite float as text.
    let args = serde_json::to_value(&fx.nodes[0].args).unwrap();
    assert_eq!(
        args,
        serde_json::json!([
            ["tensor", { "kind": "tensor", "value": "x" }],
            ["tensors", { "kind": "tensors", "value": ["x", "x"] }],
            ["optional", { "kind": "tensors", "value": ["x", null] }],
            ["none", { "kind": "none" }],
            ["int", { "kind": "int", "value": -3 }],
            ["float", { "kind": "float", "value": 1e-5 }],
            ["inf", { "kind": "float", "value": "inf" }],
            ["neg_inf", { "kind": "float", "value": "-inf" }],
            ["bool", { "kind": "bool", "value": true }],
            ["str", { "kind": "str", "value": "sum" }],
            ["ints", { "kind": "ints", "value": [-1, 2] }],
            ["floats", { "kind": "floats", "value": [0.5, "inf", 2.0] }],
            ["bools", { "kind": "bools", "value": [true, false] }],
            ["sym", { "kind": "sym", "value": "2*s0" }],
            ["syms", { "kind": "syms", "value": [4, "s0"] }],
            ["dtype", { "kind": "dtype", "value": 13 }],
            ["other", { "kind": "other", "value": "list" }],
        ])
    );
    // NaN reads back as NaN.
    let nan: FxArg = serde_json::from_str(r#"{"kind": "float", "value": "NaN"}"#).unwrap();
    assert!(matches!(nan, FxArg::Float(f) if f.is_nan()));
    assert!(serde_json::from_str::<FxArg>(r#"{"kind": "float", "value": "x"}"#).is_err());
}

#[test]
fn arguments_of_every_kind_render_into_opaque_attrs() {
    let mut fx = untypable();
    fx.nodes[0].args = every_kind();
    let imp = fx::import(&fx, &ImportOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let g = &imp.graph;
    let a = g.node(g.find("a").unwrap());
    assert_eq!(a.inputs.len(), 4);
    let Op::Opaque { attrs, .. } = &a.op else {
        panic!("{:?}", a.op)
    };
    assert_eq!(
        attrs,
        &serde_json::json!({
            "tensor": { "input": 0 },
            "tensors": [{ "input": 1 }, { "input": 2 }],
            "optional": [{ "input": 3 }, null],
            "none": null,
            "int": -3,
            "float": 1e-5,
            "inf": "inf",
            "neg_inf": "-inf",
            "bool": true,
            "str": "sum",
            "ints": [-1, 2],
            "floats": [0.5, null, 2.0],
            "bools": [true, false],
            "sym": "2*s0",
            "syms": [4, "s0"],
            "dtype": "bf16",
            "other": { "as_other": "list" },
        })
    );
}

#[test]
fn a_huge_count_of_values_that_are_not_tensors_allocates_nothing() {
    // Only tensors are values arfuse keeps: a node of none is skipped, whatever the
    // count of its other values (the JSON this form was once turned into held one
    // entry per value, and a count near usize::MAX made it panic).
    let mut fx = untypable();
    fx.nodes.insert(
        1,
        FxNode {
            name: "sym_size".into(),
            target: "aten.sym_size.int".into(),
            args: vec![
                ("self".into(), FxArg::Tensor("a".into())),
                ("dim".into(), FxArg::Int(0)),
            ],
            outputs: vec![],
            other_outputs: usize::MAX,
            module: None,
        },
    );
    let imp = fx::import(&fx, &ImportOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(imp.graph.len(), 4);
    assert!(imp
        .notes
        .contains(&"skipped 1 aten.sym_size.int node(s) computing symbolic sizes only".into()));
}
