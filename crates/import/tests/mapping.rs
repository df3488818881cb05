//! The op mapping on small hand-written programs: each ATen form the README's chains
//! use, the forms that must stay opaque, symbolic sizes and module paths.

mod common;

use arfuse_import::load_any;
use arfuse_ir::{InputKind, Op};
use common::{arg, bytes, meta, node, program, t};
use serde_json::{json, Value};

fn f32x() -> Value {
    meta(7, &[json!("s0"), json!(8)])
}
fn bf16x() -> Value {
    meta(13, &[json!("s0"), json!(8)])
}
fn int(n: i64) -> Value {
    json!({ "as_int": n })
}
fn float(x: f64) -> Value {
    json!({ "as_float": x })
}

fn canon(
    nodes: Vec<Value>,
    tensors: Vec<(&str, Value)>,
    outputs: &[&str],
) -> (String, Vec<String>) {
    let imp = load_any(&bytes(&program(nodes, tensors, outputs))).unwrap_or_else(|e| panic!("{e}"));
    (imp.graph.canonical_text(), imp.notes)
}

#[test]
fn decomposed_norm_maps_op_for_op() {
    let (text, notes) = canon(
        vec![
            node(
                "f",
                "aten.to.dtype",
                vec![
                    arg("self", t("x")),
                    arg("dtype", json!({"as_scalar_type": 7})),
                ],
                "m.layer.norm",
            ),
            node(
                "p",
                "aten.pow.Tensor_Scalar",
                vec![arg("self", t("f")), arg("exponent", int(2))],
                "m.layer.norm",
            ),
            node(
                "mn",
                "aten.mean.dim",
                vec![
                    arg("self", t("p")),
                    arg("dim", json!({"as_ints": [-1]})),
                    arg("keepdim", json!({"as_bool": true})),
                ],
                "m.layer.norm",
            ),
            node(
                "a",
                "aten.add.Tensor",
                vec![arg("self", t("mn")), arg("other", float(1e-6))],
                "m.layer.norm",
            ),
            node(
                "r",
                "aten.rsqrt.default",
                vec![arg("self", t("a"))],
                "m.layer.norm",
            ),
            node(
                "m1",
                "aten.mul.Tensor",
                vec![arg("self", t("f")), arg("other", t("r"))],
                "m.layer.norm",
            ),
            node(
                "b",
                "aten._to_copy.default",
                vec![
                    arg("self", t("m1")),
                    arg("dtype", json!({"as_scalar_type": 13})),
                ],
                "m.layer.norm",
            ),
            node(
                "y",
                "aten.mul.Tensor",
                vec![arg("self", t("w")), arg("other", t("b"))],
                "m.layer.norm",
            ),
        ],
        vec![
            ("f", f32x()),
            ("p", f32x()),
            ("mn", meta(7, &[json!("s0"), json!(1)])),
            ("a", meta(7, &[json!("s0"), json!(1)])),
            ("r", meta(7, &[json!("s0"), json!(1)])),
            ("m1", f32x()),
            ("b", bf16x()),
            ("y", bf16x()),
        ],
        &["y"],
    );
    insta::assert_snapshot!("decomposed_norm", text);
    assert!(notes.is_empty(), "{notes:?}");
}

#[test]
fn linear_with_bias_rms_norm_and_scalars() {
    let (text, notes) = canon(
        vec![
            node(
                "y",
                "aten.linear.default",
                vec![
                    arg("input", t("x")),
                    arg("weight", t("lw")),
                    arg("bias", t("lb")),
                ],
                "m.layer.proj",
            ),
            node(
                "n",
                "aten.rms_norm.default",
                vec![
                    arg("input", t("x")),
                    arg("normalized_shape", json!({"as_ints": [8]})),
                    arg("weight", t("w")),
                    arg("eps", float(1e-5)),
                ],
                "m.layer.norm",
            ),
            // alpha 3 (not a power of two: torch fuses the multiply-add) stays opaque;
            // alpha == 1 maps.
            node(
                "s",
                "aten.add.Tensor",
                vec![
                    arg("self", t("x")),
                    arg("other", t("n")),
                    arg("alpha", int(3)),
                ],
                "m.layer",
            ),
            node(
                "s1",
                "aten.add.Tensor",
                vec![
                    arg("self", t("x")),
                    arg("other", t("n")),
                    arg("alpha", int(1)),
                ],
                "m.layer",
            ),
            // Scalar mul becomes a constant of the tensor's dtype.
            node(
                "h",
                "aten.mul.Tensor",
                vec![arg("self", t("x")), arg("other", float(0.5))],
                "m.layer",
            ),
            // A cast to the same dtype and a same-shape view are forwarded.
            node(
                "same",
                "aten.to.dtype",
                vec![
                    arg("self", t("h")),
                    arg("dtype", json!({"as_scalar_type": 13})),
                ],
                "m.layer",
            ),
            node(
                "v",
                "aten.view.default",
                vec![
                    arg("self", t("same")),
                    arg("size", json!({"as_ints": [-1, 8]})),
                ],
                "m.layer",
            ),
            node(
                "u",
                "aten.unsqueeze.default",
                vec![arg("self", t("v")), arg("dim", int(0))],
                "m.layer",
            ),
        ],
        vec![
            ("y", meta(13, &[json!("s0"), json!(4)])),
            ("n", bf16x()),
            ("s", bf16x()),
            ("s1", bf16x()),
            ("h", bf16x()),
            ("same", bf16x()),
            ("v", bf16x()),
            ("u", meta(13, &[json!(1), json!("s0"), json!(8)])),
        ],
        &["y", "s", "s1", "u"],
    );
    insta::assert_snapshot!("linear_rms_norm_scalars", text);
    let notes = notes.join("\n");
    assert!(
        notes.contains("aten.add.Tensor opaque: alpha 3 is not a power of two"),
        "{notes}"
    );
    assert!(notes.contains("forwarded 1 aten.to.dtype"), "{notes}");
    assert!(notes.contains("forwarded 1 aten.view.default"), "{notes}");
}

#[test]
fn collectives_multi_output_ops_and_bool() {
    let mut topk = node(
        "topk",
        "aten.topk.default",
        vec![arg("self", t("x")), arg("k", int(2))],
        "m.layer.gate",
    );
    topk["outputs"] =
        json!([{ "as_tensor": { "name": "vals" } }, { "as_tensor": { "name": "idx" } }]);
    let mut assert_node = node(
        "chk",
        "aten._assert_tensor_metadata.default",
        vec![
            arg("a", t("ar")),
            arg("dtype", json!({"as_scalar_type": 13})),
        ],
        "m.layer",
    );
    assert_node["outputs"] = json!([]);
    let mut size = node(
        "sz",
        "aten.sym_size.int",
        vec![arg("self", t("x")), arg("dim", int(0))],
        "m.layer",
    );
    size["outputs"] = json!([{ "as_sym_int": { "as_name": "sz" } }]);
    let (text, notes) = canon(
        vec![
            size,
            node(
                "ar",
                "_c10d_functional.all_reduce.default",
                vec![
                    arg("input", t("x")),
                    arg("reduce_op", json!({"as_string": "sum"})),
                    arg("group_name", json!({"as_string": "tp0"})),
                ],
                "m.layer.proj",
            ),
            node(
                "wt",
                "_c10d_functional.wait_tensor.default",
                vec![arg("tensor", t("ar"))],
                "m.layer.proj",
            ),
            assert_node,
            node(
                "mx",
                "_c10d_functional.all_reduce.default",
                vec![
                    arg("input", t("x")),
                    arg("reduce_op", json!({"as_string": "max"})),
                    arg("group_name", json!({"as_string": "tp0"})),
                ],
                "m.layer.proj",
            ),
            topk,
            node(
                "gt",
                "aten.gt.Scalar",
                vec![arg("self", t("vals")), arg("other", int(0))],
                "m.layer.gate",
            ),
            node(
                "sl",
                "aten.slice.Tensor",
                vec![
                    arg("self", t("wt")),
                    arg("dim", int(0)),
                    arg("start", int(1)),
                ],
                "m.layer",
            ),
        ],
        vec![
            ("ar", bf16x()),
            ("wt", bf16x()),
            ("mx", bf16x()),
            ("vals", meta(13, &[json!("s0"), json!(2)])),
            ("idx", meta(5, &[json!("s0"), json!(2)])),
            ("gt", meta(12, &[json!("s0"), json!(2)])),
            (
                "sl",
                meta(
                    13,
                    &[
                        json!("Add(Symbol('s0', positive=True, integer=True), Integer(-1))"),
                        json!(8),
                    ],
                ),
            ),
        ],
        &["wt", "mx", "idx", "gt", "sl"],
    );
    insta::assert_snapshot!("collectives_multi_output_bool", text);
    let notes = notes.join("\n");
    for want in [
        "dropped 1 aten._assert_tensor_metadata.default check(s)",
        "forwarded 1 _c10d_functional.wait_tensor.default",
        "skipped 1 aten.sym_size.int",
        "typed 1 bool tensor(s) as u8",
        "reduce op \"max\"",
        "fresh symbol x0 in 1..=4095",
    ] {
        assert!(notes.contains(want), "missing {want:?} in\n{notes}");
    }
}

#[test]
fn inputs_kinds_and_module_paths() {
    let imp = load_any(&bytes(&program(
        vec![node(
            "y",
            "aten.rsqrt.default",
            vec![arg("self", t("x"))],
            "m.layer.norm",
        )],
        vec![("y", bf16x())],
        &["y"],
    )))
    .unwrap();
    let g = &imp.graph;
    let get = |id: &str| g.node(g.find(id).unwrap());
    assert!(matches!(
        get("w").op,
        Op::Input {
            kind: InputKind::Parameter
        }
    ));
    assert!(matches!(
        get("x").op,
        Op::Input {
            kind: InputKind::Activation
        }
    ));
    // Every parameter starts with `m.`: that wrapper segment is removed.
    assert_eq!(get("w").module.as_deref(), Some("layer.norm"));
    assert_eq!(get("y").module.as_deref(), Some("layer.norm"));
    assert_eq!(get("x").module, None);
    let md = g.metadata().unwrap();
    assert_eq!(md["module_prefix_removed"], "m");
    assert_eq!(md["schema_version"], "8.20");
    assert_eq!(g.symbols()["s0"].min, 2);
    assert_eq!(g.symbols()["s0"].max, 4096);
}

#[test]
fn ids_are_sanitized_and_unique() {
    let (text, _) = canon(
        vec![
            node(
                "a b:c",
                "aten.rsqrt.default",
                vec![arg("self", t("x"))],
                "m.layer",
            ),
            node(
                "y",
                "aten.mul.Tensor",
                vec![arg("self", t("a b:c")), arg("other", float(2.0))],
                "m.layer",
            ),
        ],
        vec![("a b:c", bf16x()), ("y", bf16x())],
        &["y"],
    );
    assert!(text.contains("rsqrt"), "{text}");
    let imp = load_any(&bytes(&program(
        vec![node(
            "a b:c",
            "aten.rsqrt.default",
            vec![arg("self", t("x"))],
            "m.layer",
        )],
        vec![("a b:c", bf16x())],
        &["a b:c"],
    )))
    .unwrap();
    assert!(imp.graph.find("a_b_c").is_some());
}

#[test]
fn an_rms_norm_eps_that_is_missing_not_a_number_or_out_of_range_is_said() {
    for (eps, expected) in [
        (
            None,
            "no explicit eps (torch's default depends on the dtype)",
        ),
        (Some(json!({"as_none": true})), "no explicit eps"),
        (
            Some(json!({"as_float": "NaN"})),
            "eps is not a number: {\"as_float\":\"NaN\"}",
        ),
        (
            Some(float(2.0)),
            "eps = 2 is not an RMSNorm epsilon (finite, in (0, 1), non-zero in f32)",
        ),
        (Some(float(1e-300)), "is not an RMSNorm epsilon"),
    ] {
        let mut args = vec![
            arg("input", t("x")),
            arg("normalized_shape", json!({"as_ints": [8]})),
            arg("weight", t("w")),
        ];
        if let Some(e) = eps.clone() {
            args.push(arg("eps", e));
        }
        let (text, notes) = canon(
            vec![node("n", "aten.rms_norm.default", args, "m.norm")],
            vec![("x", bf16x()), ("w", meta(13, &[json!(8)])), ("n", bf16x())],
            &["n"],
        );
        assert!(!text.contains("rms_norm("), "{eps:?}: {text}");
        let notes = notes.join("\n");
        assert!(notes.contains(expected), "{eps:?}: {notes}");
    }
}
