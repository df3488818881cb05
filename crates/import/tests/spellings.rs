//! The spellings real graphs use for the pattern's ops, on small hand-written programs:
//! torch's type promotion made explicit, every all-reduce spelling (and the warning for
//! collective-looking ops that are not understood), in-place ops, the post-grad forms
//! of torch.compile (`prims.convert_element_type`, `sum` + division), gzip input.

mod common;

use arfuse_import::{load_any, load_any_with, CustomAllReduce, ImportOptions, Imported};
use arfuse_ir::{Graph, Op, Value};
use common::{arg, bytes, meta, node, program, t};
use serde_json::{json, Value as Json};

fn bf16x() -> Json {
    meta(13, &[json!("s0"), json!(8)])
}
fn f32x() -> Json {
    meta(7, &[json!("s0"), json!(8)])
}
fn float(x: f64) -> Json {
    json!({ "as_float": x })
}
fn int(n: i64) -> Json {
    json!({ "as_int": n })
}
fn string(s: &str) -> Json {
    json!({ "as_string": s })
}
fn dtype(code: i64) -> Json {
    json!({ "as_scalar_type": code })
}

fn import(nodes: Vec<Json>, tensors: Vec<(&str, Json)>, outputs: &[&str]) -> Imported {
    import_with(nodes, tensors, outputs, &ImportOptions::default())
}

fn import_with(
    nodes: Vec<Json>,
    tensors: Vec<(&str, Json)>,
    outputs: &[&str],
    opts: &ImportOptions,
) -> Imported {
    load_any_with(&bytes(&program(nodes, tensors, outputs)), opts).unwrap_or_else(|e| panic!("{e}"))
}

/// The expression computing `v`: IR ops with their dtype or attribute, down to graph
/// inputs, constants and opaque nodes (named by id).
fn expr(g: &Graph, v: Value) -> String {
    let n = g.node(v.node);
    let args = || {
        n.inputs
            .iter()
            .map(|i| expr(g, *i))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match &n.op {
        Op::Input { .. } => n.id.clone(),
        Op::Opaque { target, .. } => format!("opaque[{target}]"),
        Op::Constant { value } => format!("{value}:{}", n.outputs[0].dtype),
        Op::ToDtype { dtype } => format!("to_{dtype}({})", args()),
        Op::AllReduce { group, .. } => format!("all_reduce[{group}]({})", args()),
        Op::Mean { dims, keepdim } => format!(
            "mean{dims:?}{}({})",
            if *keepdim { "k" } else { "" },
            args()
        ),
        op => format!("{}:{}({})", op.name(), n.outputs[0].dtype, args()),
    }
}

/// The expression of graph output `k`.
fn out(imp: &Imported, k: usize) -> String {
    expr(&imp.graph, imp.graph.outputs()[k])
}

fn notes(imp: &Imported) -> String {
    imp.notes.join("\n")
}

/// `xf = prims.convert_element_type(x, f32)`: an f32 activation for the tests.
fn to_f32(name: &str, of: &str) -> Json {
    node(
        name,
        "prims.convert_element_type.default",
        vec![arg("a", t(of)), arg("dtype", dtype(7))],
        "m.layer.norm",
    )
}

#[test]
fn mixed_dtype_operands_are_promoted_explicitly() {
    let imp = import(
        vec![
            to_f32("xf", "x"),
            // gpt-oss' norm tail: bf16 weight times f32 activations, f32 result.
            node(
                "y",
                "aten.mul.Tensor",
                vec![arg("self", t("w")), arg("other", t("xf"))],
                "m.layer.norm",
            ),
            // f32 + bf16 in either order.
            node(
                "z",
                "aten.add.Tensor",
                vec![arg("self", t("xf")), arg("other", t("x"))],
                "m.layer",
            ),
        ],
        vec![("xf", f32x()), ("y", f32x()), ("z", f32x())],
        &["y", "z"],
    );
    assert_eq!(out(&imp, 0), "mul:f32(to_f32(w), to_f32(x))");
    assert_eq!(out(&imp, 1), "add:f32(to_f32(x), to_f32(x))");
    assert!(notes(&imp).is_empty(), "{}", notes(&imp));
}

#[test]
fn python_scalars_enter_at_f32_unless_exact_in_the_result_dtype() {
    let imp = import(
        vec![
            node(
                "a",
                "aten.mul.Tensor",
                vec![arg("self", t("x")), arg("other", float(0.5))],
                "m",
            ),
            // 0.1 is not a bf16 value: torch multiplies by the f32 0.1 and rounds once.
            node(
                "b",
                "aten.mul.Tensor",
                vec![arg("self", t("x")), arg("other", float(0.1))],
                "m",
            ),
            // An f32 tensor takes any scalar as an f32 constant.
            to_f32("xf", "x"),
            node(
                "c",
                "aten.add.Tensor",
                vec![arg("self", t("xf")), arg("other", float(1e-6))],
                "m",
            ),
        ],
        vec![
            ("a", bf16x()),
            ("b", bf16x()),
            ("xf", f32x()),
            ("c", f32x()),
        ],
        &["a", "b", "c"],
    );
    assert_eq!(out(&imp, 0), "mul:bf16(x, 0.5:bf16)");
    assert_eq!(out(&imp, 1), "to_bf16(mul:f32(to_f32(x), 0.1:f32))");
    assert_eq!(out(&imp, 2), "add:f32(to_f32(x), 0.000001:f32)");
}

#[test]
fn alpha_is_exact_or_refused() {
    let add = |name: &str, alpha: Json| {
        node(
            name,
            "aten.add.Tensor",
            vec![
                arg("self", t("x")),
                arg("other", t("w")),
                arg("alpha", alpha),
            ],
            "m",
        )
    };
    let imp = import(
        vec![
            add("one", int(1)),
            add("neg", int(-1)),
            add("two", float(2.0)),
            add("three", int(3)),
        ],
        vec![
            ("one", bf16x()),
            ("neg", bf16x()),
            ("two", bf16x()),
            ("three", bf16x()),
        ],
        &["one", "neg", "two", "three"],
    );
    assert_eq!(out(&imp, 0), "add:bf16(x, w)");
    assert_eq!(out(&imp, 1), "add:bf16(x, mul:bf16(w, -1:bf16))");
    assert_eq!(
        out(&imp, 2),
        "to_bf16(add:f32(to_f32(x), mul:f32(to_f32(w), 2:f32)))"
    );
    assert_eq!(out(&imp, 3), "opaque[aten.add.Tensor]");
    assert!(
        notes(&imp).contains("alpha 3 is not a power of two"),
        "{}",
        notes(&imp)
    );
}

#[test]
fn zero_dim_operands_of_another_dtype_and_integer_results_stay_opaque() {
    let mut sc = node(
        "c",
        "aten.scalar_tensor.default",
        vec![arg("s", float(2.0))],
        "m",
    );
    sc["outputs"] = json!([{ "as_tensor": { "name": "c" } }]);
    let imp = import(
        vec![
            sc,
            node(
                "y",
                "aten.mul.Tensor",
                vec![arg("self", t("x")), arg("other", t("c"))],
                "m",
            ),
        ],
        vec![("c", meta(7, &[])), ("y", bf16x())],
        &["y"],
    );
    assert_eq!(out(&imp, 0), "opaque[aten.mul.Tensor]");
    assert!(
        notes(&imp).contains("a 0-dim f32 tensor operand with a bf16 result"),
        "{}",
        notes(&imp)
    );
}

// ---- collectives -------------------------------------------------------------------

fn functional_ar(name: &str, target: &str, input: &str, reduce: &str) -> Json {
    node(
        name,
        target,
        vec![
            arg("input", t(input)),
            arg("reduce_op", string(reduce)),
            arg("group_name", string("tp0")),
        ],
        "m.layer.proj",
    )
}

#[test]
fn in_place_functional_all_reduce_rebinds_its_input() {
    // After `all_reduce_(x)`, a reader of `x` reads the sum (the graph runs in order).
    let imp = import(
        vec![
            node(
                "pre",
                "aten.mul.Tensor",
                vec![arg("self", t("x")), arg("other", t("x"))],
                "m",
            ),
            functional_ar("ar", "_c10d_functional.all_reduce_.default", "pre", "sum"),
            node(
                "wt",
                "_c10d_functional.wait_tensor.default",
                vec![arg("tensor", t("ar"))],
                "m",
            ),
            node(
                "y",
                "aten.add.Tensor",
                vec![arg("self", t("pre")), arg("other", t("x"))],
                "m",
            ),
        ],
        vec![
            ("pre", bf16x()),
            ("ar", bf16x()),
            ("wt", bf16x()),
            ("y", bf16x()),
        ],
        &["y", "wt"],
    );
    assert_eq!(out(&imp, 0), "add:bf16(all_reduce[tp0](mul:bf16(x, x)), x)");
    assert_eq!(out(&imp, 1), "all_reduce[tp0](mul:bf16(x, x))");
}

#[test]
fn dist_all_reduce_exports_as_all_reduce_wait_and_copy() {
    // torch.export of `dist.all_reduce(y)`: all_reduce, wait_tensor, copy_(y, waited),
    // and the model reads copy_'s output (or y itself after it).
    let imp = import(
        vec![
            node(
                "y",
                "aten.mul.Tensor",
                vec![arg("self", t("x")), arg("other", t("x"))],
                "m",
            ),
            functional_ar("ar", "_c10d_functional.all_reduce.default", "y", "sum"),
            node(
                "wt",
                "_c10d_functional.wait_tensor.default",
                vec![arg("tensor", t("ar"))],
                "m",
            ),
            node(
                "cp",
                "aten.copy_.default",
                vec![arg("self", t("y")), arg("src", t("wt"))],
                "m",
            ),
            node(
                "h",
                "aten.add.Tensor",
                vec![arg("self", t("cp")), arg("other", t("x"))],
                "m",
            ),
            node(
                "h2",
                "aten.add.Tensor",
                vec![arg("self", t("y")), arg("other", t("x"))],
                "m",
            ),
        ],
        vec![
            ("y", bf16x()),
            ("ar", bf16x()),
            ("wt", bf16x()),
            ("cp", bf16x()),
            ("h", bf16x()),
            ("h2", bf16x()),
        ],
        &["h", "h2"],
    );
    let want = "add:bf16(all_reduce[tp0](mul:bf16(x, x)), x)";
    assert_eq!(out(&imp, 0), want);
    assert_eq!(out(&imp, 1), want);
    assert!(
        notes(&imp).contains("forwarded 1 aten.copy_.default"),
        "{}",
        notes(&imp)
    );
}

fn c10d_allreduce(reduce: Json) -> Json {
    let mut n = node(
        "ar",
        "c10d.allreduce_.default",
        vec![
            arg("tensors", json!({ "as_tensors": [{ "name": "x" }] })),
            arg(
                "process_group",
                json!({ "as_custom_obj": { "name": "pg_tp", "class_fqn": "__torch__.torch.classes.c10d.ProcessGroup" } }),
            ),
            arg("reduce_op", reduce),
            arg("sparse_indices", json!({ "as_none": true })),
            arg("async_op", json!({ "as_bool": false })),
            arg("timeout", int(-1)),
        ],
        "m.layer.proj",
    );
    n["outputs"] = json!([
        { "as_tensors": [{ "name": "ar_0" }] },
        { "as_custom_obj": { "name": "work", "class_fqn": "__torch__.torch.classes.c10d.Work" } }
    ]);
    n
}

fn after_c10d() -> Json {
    // Reads the mutated tensor by its old name.
    node(
        "y",
        "aten.add.Tensor",
        vec![arg("self", t("x")), arg("other", t("w"))],
        "m",
    )
}

#[test]
fn c10d_allreduce_in_place_with_a_readable_sum() {
    let imp = import(
        vec![c10d_allreduce(int(0)), after_c10d()],
        vec![("ar_0", bf16x()), ("y", bf16x())],
        &["y", "ar_0"],
    );
    assert_eq!(out(&imp, 0), "add:bf16(all_reduce[pg_tp](x), w)");
    assert_eq!(out(&imp, 1), "all_reduce[pg_tp](x)");
    let imp = import(
        vec![c10d_allreduce(int(4)), after_c10d()],
        vec![("ar_0", bf16x()), ("y", bf16x())],
        &["y"],
    );
    assert!(out(&imp, 0).contains("opaque[c10d.allreduce_.default]"));
    let n = notes(&imp);
    assert!(
        n.contains("reduce op code 4 (only sum, code 0, is modelled)"),
        "{n}"
    );
    assert!(
        n.contains("warning: c10d.allreduce_.default: looks like a collective"),
        "{n}"
    );
}

#[test]
fn c10d_allreduce_with_a_reduce_op_object_needs_the_option() {
    let obj = json!({ "as_custom_obj": { "name": "sum_op", "class_fqn": "__torch__.torch.classes.c10d.ReduceOp" } });
    let plain = import(
        vec![c10d_allreduce(obj.clone()), after_c10d()],
        vec![("ar_0", bf16x()), ("y", bf16x())],
        &["y"],
    );
    let n = notes(&plain);
    assert!(n.contains("the reduce op is a ReduceOp object"), "{n}");
    assert!(n.contains("sites it stands for may be missed"), "{n}");
    let opts = ImportOptions::default()
        .with_all_reduce_op("c10d.allreduce_=tp".parse::<CustomAllReduce>().unwrap());
    let named = import_with(
        vec![c10d_allreduce(obj), after_c10d()],
        vec![("ar_0", bf16x()), ("y", bf16x())],
        &["y"],
        &opts,
    );
    assert_eq!(out(&named, 0), "add:bf16(all_reduce[tp](x), w)");
}

fn vllm_ar(name: &str, input: &str) -> Json {
    node(
        name,
        "vllm.all_reduce.default",
        vec![arg("tensor", t(input)), arg("group_name", string("tp:0"))],
        "m.layer.proj",
    )
}

#[test]
fn a_framework_all_reduce_is_opt_in_by_name() {
    let nodes = || {
        vec![
            vllm_ar("ar", "x"),
            node(
                "y",
                "aten.add.Tensor",
                vec![arg("self", t("ar")), arg("other", t("x"))],
                "m",
            ),
        ]
    };
    let tensors = || vec![("ar", bf16x()), ("y", bf16x())];
    let plain = import(nodes(), tensors(), &["y"]);
    assert_eq!(
        out(&plain, 0),
        "add:bf16(opaque[vllm.all_reduce.default], x)"
    );
    assert!(notes(&plain).contains("warning: vllm.all_reduce.default: looks like a collective"));
    let opts = ImportOptions::default().with_all_reduce_op(CustomAllReduce::new("vllm.all_reduce"));
    let named = import_with(nodes(), tensors(), &["y"], &opts);
    assert_eq!(out(&named, 0), "add:bf16(all_reduce[tp:0](x), x)");
    assert!(!notes(&named).contains("warning"), "{}", notes(&named));
    let grouped = ImportOptions::default()
        .with_all_reduce_op(CustomAllReduce::new("vllm.all_reduce").with_group("tp"));
    let named = import_with(nodes(), tensors(), &["y"], &grouped);
    assert_eq!(out(&named, 0), "add:bf16(all_reduce[tp](x), x)");
}

#[test]
fn other_reduce_ops_and_other_collectives_are_refused_with_a_warning() {
    let mut ag = node(
        "ag",
        "_c10d_functional.all_gather_into_tensor.default",
        vec![
            arg("input", t("x")),
            arg("group_size", int(2)),
            arg("group_name", string("tp0")),
        ],
        "m",
    );
    ag["outputs"] = json!([{ "as_tensor": { "name": "ag" } }]);
    let imp = import(
        vec![
            functional_ar("mx", "_c10d_functional.all_reduce.default", "x", "max"),
            ag,
        ],
        vec![
            ("mx", bf16x()),
            ("ag", meta(13, &[json!("2*s0"), json!(8)])),
        ],
        &["mx", "ag"],
    );
    assert_eq!(out(&imp, 0), "opaque[_c10d_functional.all_reduce.default]");
    let n = notes(&imp);
    assert!(
        n.contains("reduce op \"max\" (only sum is modelled)"),
        "{n}"
    );
    assert!(
        n.contains("warning: _c10d_functional.all_reduce.default"),
        "{n}"
    );
    assert!(
        n.contains("warning: _c10d_functional.all_gather_into_tensor.default"),
        "{n}"
    );
}

// ---- post-grad spellings -------------------------------------------------------------

fn sum_last(name: &str, of: &str) -> Json {
    node(
        name,
        "aten.sum.dim_IntList",
        vec![
            arg("self", t(of)),
            arg("dim", json!({ "as_ints": [-1] })),
            arg("keepdim", json!({ "as_bool": true })),
        ],
        "m.layer.norm",
    )
}

fn div(name: &str, of: &str, by: Json) -> Json {
    node(
        name,
        "aten.div.Tensor",
        vec![arg("self", t(of)), arg("other", by)],
        "m.layer.norm",
    )
}

#[test]
fn sum_divided_by_its_count_is_a_mean() {
    let col = || meta(7, &[json!("s0"), json!(1)]);
    let imp = import(
        vec![
            to_f32("xf", "x"),
            node(
                "sq",
                "aten.mul.Tensor",
                vec![arg("self", t("xf")), arg("other", t("xf"))],
                "m.layer.norm",
            ),
            sum_last("s", "sq"),
            div("ms", "s", int(8)),
            // Divided by another count: a sum and a division, both opaque.
            sum_last("s2", "sq"),
            div("ms2", "s2", float(7.0)),
            // A bf16 sum rounds before the division: not a mean.
            sum_last("s3", "x"),
            div("ms3", "s3", int(8)),
        ],
        vec![
            ("xf", f32x()),
            ("sq", f32x()),
            ("s", col()),
            ("ms", col()),
            ("s2", col()),
            ("ms2", col()),
            ("s3", meta(13, &[json!("s0"), json!(1)])),
            ("ms3", meta(13, &[json!("s0"), json!(1)])),
        ],
        &["ms", "ms2", "ms3"],
    );
    assert_eq!(out(&imp, 0), "mean[-1]k(mul:f32(to_f32(x), to_f32(x)))");
    assert_eq!(out(&imp, 1), "opaque[aten.div.Tensor]");
    assert_eq!(out(&imp, 2), "opaque[aten.div.Tensor]");
    assert!(notes(&imp).contains("a division of a sum by its element count, now a mean"));
}

#[test]
fn post_grad_casts_and_views() {
    let imp = import(
        vec![
            to_f32("xf", "x"),
            node(
                "v",
                "aten._unsafe_view.default",
                vec![
                    arg("self", t("xf")),
                    arg("size", json!({ "as_ints": [1, -1, 8] })),
                ],
                "m",
            ),
            node(
                "b",
                "aten._to_copy.default",
                vec![arg("self", t("v")), arg("dtype", dtype(13))],
                "m",
            ),
        ],
        vec![
            ("xf", f32x()),
            ("v", meta(7, &[json!(1), json!("s0"), json!(8)])),
            ("b", meta(13, &[json!(1), json!("s0"), json!(8)])),
        ],
        &["b"],
    );
    assert_eq!(out(&imp, 0), "to_bf16(reshape:f32(to_f32(x)))");
}

// ---- gzip -----------------------------------------------------------------------------

fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

#[test]
fn gzip_compressed_json_imports_the_same() {
    let raw = common::export_bytes("llama31_8b_L2_tp8");
    let plain = load_any(&raw).unwrap();
    let gz = gzip(&raw);
    assert_eq!(arfuse_import::detect(&gz), arfuse_import::Format::Gzip);
    let imp = load_any(&gz).unwrap();
    assert_eq!(imp.graph.canonical_text(), plain.graph.canonical_text());
    assert_eq!(imp.notes, plain.notes);
    let err = load_any(&gzip(&gz)).unwrap_err().to_string();
    assert!(err.contains("itself compressed"), "{err}");
    let mut cut = gz.clone();
    cut.truncate(gz.len() / 2);
    let err = load_any(&cut).unwrap_err().to_string();
    assert!(err.starts_with("gzip:"), "{err}");
}

#[test]
fn tensor_names_map_to_the_values_they_were_imported_as() {
    // The in-place all-reduce of the test above: `pre` keeps the value it was produced
    // as (its readers after `all_reduce_` are rebound, the map is not), `wt` is
    // forwarded to the all-reduce, graph inputs map to their input nodes.
    let imp = import(
        vec![
            node(
                "pre",
                "aten.mul.Tensor",
                vec![arg("self", t("x")), arg("other", t("x"))],
                "m",
            ),
            functional_ar("ar", "_c10d_functional.all_reduce_.default", "pre", "sum"),
            node(
                "wt",
                "_c10d_functional.wait_tensor.default",
                vec![arg("tensor", t("ar"))],
                "m",
            ),
        ],
        vec![("pre", bf16x()), ("ar", bf16x()), ("wt", bf16x())],
        &["wt"],
    );
    let g = &imp.graph;
    let id = |name: &str| g.node(imp.tensors[name].node).id.clone();
    assert_eq!(id("x"), "x");
    assert_eq!(id("w"), "w");
    assert_eq!(id("pre"), "pre");
    assert!(matches!(g.node(imp.tensors["pre"].node).op, Op::Mul));
    assert_eq!(id("ar"), "ar");
    assert_eq!(imp.tensors["wt"], imp.tensors["ar"]);
    assert_eq!(imp.tensors.len(), 7, "{:?}", imp.tensors.keys());
}

#[test]
fn arfuse_per_token_quant_op_is_the_ir_quant() {
    let q = json!({
        "target": "torch.ops.arfuse.quant_fp8_per_token.default",
        "inputs": [arg("input", t("x"))],
        "outputs": [ { "as_tensor": { "name": "q" } }, { "as_tensor": { "name": "s" } } ],
        "metadata": {}
    });
    let imp = import(
        vec![q],
        vec![
            ("q", meta(29, &[json!("s0"), json!(8)])),
            ("s", meta(7, &[json!("s0"), json!(1)])),
        ],
        &["q", "s"],
    );
    let g = &imp.graph;
    let n = g.node(g.outputs()[0].node);
    assert!(matches!(n.op, Op::QuantFp8PerToken), "{:?}", n.op);
    assert_eq!(g.outputs()[1], Value::new(g.outputs()[0].node, 1));
    assert_eq!(imp.tensors["s"], g.outputs()[1]);
    assert!(imp.opaque_targets.is_empty());
    // With the wrong output types (scales not f32), it stays opaque, with the reason.
    let q = json!({
        "target": "torch.ops.arfuse.quant_fp8_per_token.default",
        "inputs": [arg("input", t("x"))],
        "outputs": [ { "as_tensor": { "name": "q" } }, { "as_tensor": { "name": "s" } } ],
        "metadata": {}
    });
    let imp = import(
        vec![q],
        vec![
            ("q", meta(29, &[json!("s0"), json!(8)])),
            ("s", meta(13, &[json!("s0"), json!(1)])),
        ],
        &["q"],
    );
    assert!(imp
        .opaque_targets
        .contains("arfuse.quant_fp8_per_token.default"));
}
