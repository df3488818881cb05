//! The three torch.export fixtures (Llama-3.1-8B, Qwen3-30B-A3B, Gemma-3-1B; two layers
//! each, tensor-parallel all-reduces inserted): they import, validate, round-trip
//! through arfuse JSON, load from a `.pt2` archive, and hold exactly the all-reduce ->
//! (add ->) decomposed-norm chains their README describes.

mod common;

use arfuse_import::{detect, load_any, torch_export, Format, Imported};
use arfuse_ir::{DType, Graph, NodeId, Op, Value};
use common::{export_bytes, EXPORTS};
use std::collections::BTreeMap;
use std::io::Write;

fn import(stem: &str) -> Imported {
    let bytes = export_bytes(stem);
    assert_eq!(detect(&bytes), Format::TorchExportJson, "{stem}");
    load_any(&bytes).unwrap_or_else(|e| panic!("{stem}: {e}"))
}

#[test]
fn each_export_imports_validates_and_round_trips() {
    for stem in EXPORTS {
        let imp = import(stem);
        imp.graph
            .validate()
            .unwrap_or_else(|p| panic!("{stem}: {p}"));
        let json = imp.graph.to_json_string();
        assert_eq!(detect(json.as_bytes()), Format::ArfuseJson);
        let back = Graph::from_json_str(&json).unwrap_or_else(|e| panic!("{stem}: {e}"));
        assert_eq!(back.canonical_text(), imp.graph.canonical_text(), "{stem}");
        assert_eq!(back.to_json_string(), json, "{stem}");
        // load_any on the arfuse JSON gives the same graph and the same opaque set.
        let again = load_any(json.as_bytes()).unwrap();
        assert_eq!(again.graph.canonical_text(), imp.graph.canonical_text());
        assert_eq!(again.opaque_targets, imp.opaque_targets);
        assert!(again.notes.is_empty());
    }
}

#[test]
fn imported_graphs_snapshot() {
    for stem in EXPORTS {
        let imp = import(stem);
        insta::assert_snapshot!(format!("graph_{stem}"), imp.graph.canonical_text());
    }
}

/// Node count per op, symbols, metadata, notes and opaque targets: the review-sized view.
fn summary(imp: &Imported) -> String {
    let g = &imp.graph;
    let mut ops: BTreeMap<String, usize> = BTreeMap::new();
    for (_, n) in g.nodes() {
        let key = match &n.op {
            Op::Opaque { target, .. } => format!("opaque {target}"),
            op => op.name().to_string(),
        };
        *ops.entry(key).or_insert(0) += 1;
    }
    let mut s = String::new();
    s.push_str(&format!("nodes: {}\n", g.len()));
    for (name, r) in g.symbols() {
        s.push_str(&format!("symbol {name}: {}..={}\n", r.min, r.max));
    }
    s.push_str(&format!(
        "metadata: {}\n",
        g.metadata().map(|m| m.to_string()).unwrap_or_default()
    ));
    s.push_str("ops:\n");
    for (k, v) in ops {
        s.push_str(&format!("  {v:4} {k}\n"));
    }
    s.push_str("notes:\n");
    for n in &imp.notes {
        s.push_str(&format!("  {n}\n"));
    }
    s
}

#[test]
fn summaries_snapshot() {
    for stem in EXPORTS {
        insta::assert_snapshot!(format!("summary_{stem}"), summary(&import(stem)));
    }
}

/// Every target that stays opaque, per file: a new unmapped op shows up here in review.
#[test]
fn opaque_targets_per_file() {
    let mut s = String::new();
    for stem in EXPORTS {
        let imp = import(stem);
        s.push_str(&format!("{stem}:\n"));
        for t in &imp.opaque_targets {
            s.push_str(&format!("  {t}\n"));
        }
    }
    insta::assert_snapshot!("opaque_targets", s);
}

/// Every ATen/collective target of each file is accounted for: mapped (absent from the
/// opaque set or present with some mapped instances), opaque, dropped or forwarded.
#[test]
fn every_target_is_mapped_opaque_or_dropped() {
    for stem in EXPORTS {
        let bytes = export_bytes(stem);
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let imp = import(stem);
        let notes = imp.notes.join("\n");
        let nodes = v["graph_module"]["graph"]["nodes"].as_array().unwrap();
        for n in nodes {
            let target = torch_export::short_target(n["target"].as_str().unwrap());
            let accounted = imp.opaque_targets.contains(target)
                || notes.contains(target)
                || MAPPED.contains(&target);
            assert!(
                accounted,
                "{stem}: target {target} is neither mapped, opaque nor noted"
            );
        }
    }
}

/// Targets the importer maps onto IR ops (any instance that does not fit stays opaque).
const MAPPED: &[&str] = &[
    "_c10d_functional.all_reduce.default",
    "aten.add.Tensor",
    "aten.mul.Tensor",
    "aten.pow.Tensor_Scalar",
    "aten.mean.dim",
    "aten.rsqrt.default",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten.to.device",
    "aten.type_as.default",
    "aten.view.default",
    "aten.reshape.default",
    "aten.unsqueeze.default",
    "aten.expand.default",
    "aten.linear.default",
    "aten.embedding.default",
];

// ---- the chains the README describes ------------------------------------------------

fn users(g: &Graph, v: Value) -> Vec<NodeId> {
    let mut u: Vec<NodeId> = g
        .users(v.node)
        .filter(|(_, e)| e.output == v.output)
        .map(|(n, _)| n)
        .collect();
    u.sort();
    u.dedup();
    u
}

fn out0(n: NodeId) -> Value {
    Value::new(n, 0)
}

/// Follows single-user reshapes from `v`.
fn through_reshapes(g: &Graph, mut v: Value) -> Value {
    loop {
        let u = users(g, v);
        match u.as_slice() {
            [one] if matches!(g.node(*one).op, Op::Reshape) => v = out0(*one),
            _ => return v,
        }
    }
}

/// The module of the decomposed RMSNorm that starts at `v` (a bf16 activation): `to
/// f32 -> pow 2 -> mean(-1, keepdim) -> add eps -> rsqrt -> mul`, then either `to bf16
/// -> mul weight` or `mul (1 + weight.float()) -> to bf16`.
fn decomposed_norm(g: &Graph, v: Value) -> Option<String> {
    for u in users(g, v) {
        let n = g.node(u);
        if !matches!(n.op, Op::ToDtype { dtype: DType::F32 }) {
            continue;
        }
        let x32 = out0(u);
        let next =
            |v: Value, f: &dyn Fn(&Op) -> bool| users(g, v).into_iter().find(|&w| f(&g.node(w).op));
        let pow = next(
            x32,
            &|o| matches!(o, Op::Pow { exponent } if *exponent == 2.0),
        )?;
        let mean = next(
            out0(pow),
            &|o| matches!(o, Op::Mean { dims, keepdim: true } if dims == &[-1]),
        )?;
        let add = next(out0(mean), &|o| matches!(o, Op::Add))?;
        let eps_ok = g.node(add).inputs.iter().any(
            |i| matches!(g.node(i.node).op, Op::Constant { value } if value > 0.0 && value < 1e-3),
        );
        let rsqrt = next(out0(add), &|o| matches!(o, Op::Rsqrt))?;
        let mul = next(out0(rsqrt), &|o| matches!(o, Op::Mul))?;
        if !eps_ok || !g.node(mul).inputs.contains(&x32) {
            return None;
        }
        // Llama/Qwen: to bf16 then mul by weight; Gemma: mul by (w.float() + 1) then to bf16.
        let after = users(g, out0(mul));
        let tail_ok = match after.as_slice() {
            [one] => match &g.node(*one).op {
                Op::ToDtype { dtype: DType::Bf16 } => users(g, out0(*one))
                    .iter()
                    .any(|&w| matches!(g.node(w).op, Op::Mul)),
                Op::Mul => users(g, out0(*one))
                    .iter()
                    .any(|&w| matches!(g.node(w).op, Op::ToDtype { dtype: DType::Bf16 })),
                _ => false,
            },
            _ => false,
        };
        if tail_ok {
            return g.node(u).module.clone();
        }
    }
    None
}

/// One line per all-reduce: its module, and the norm it feeds directly or through a
/// residual add (either operand order), as `ar_module -> [add ->] norm_module`.
fn chains(g: &Graph) -> Vec<String> {
    let mut out = Vec::new();
    for (id, n) in g.nodes() {
        let Op::AllReduce { group, .. } = &n.op else {
            continue;
        };
        let ar = n.module.clone().unwrap_or_default();
        let v = through_reshapes(g, out0(id));
        if let Some(norm) = decomposed_norm(g, v) {
            out.push(format!("{ar} (group {group}) -> {norm}"));
            continue;
        }
        let adds: Vec<NodeId> = users(g, v)
            .into_iter()
            .filter(|&u| matches!(g.node(u).op, Op::Add))
            .collect();
        match adds.as_slice() {
            [add] => {
                let pos = g.node(*add).inputs.iter().position(|i| *i == v);
                match decomposed_norm(g, out0(*add)) {
                    Some(norm) => out.push(format!(
                        "{ar} (group {group}) -> add (operand {}) -> {norm}",
                        pos.unwrap_or(9)
                    )),
                    None => out.push(format!("{ar}: add without a norm after it")),
                }
            }
            _ => out.push(format!("{ar}: feeds no norm")),
        }
    }
    out
}

#[test]
fn all_reduce_norm_chains_match_the_readme() {
    let mut s = String::new();
    for stem in EXPORTS {
        let imp = import(stem);
        let c = chains(&imp.graph);
        assert_eq!(c.len(), 5, "{stem}: five all-reduces per the README");
        assert!(
            c.iter().all(|l| l.contains(" -> ")),
            "{stem}: every all-reduce feeds a norm: {c:#?}"
        );
        s.push_str(&format!("{stem}:\n"));
        for l in c {
            s.push_str(&format!("  {l}\n"));
        }
    }
    insta::assert_snapshot!("chains", s);
}

/// No check op survives as a user of an all-reduce.
#[test]
fn checks_are_not_users() {
    for stem in EXPORTS {
        let imp = import(stem);
        let g = &imp.graph;
        for (id, n) in g.nodes() {
            if let Op::Opaque { target, .. } = &n.op {
                assert!(!target.contains("assert"), "{stem}: {target} kept");
            }
            if matches!(n.op, Op::AllReduce { .. }) {
                for u in users(g, out0(id)) {
                    assert!(
                        !matches!(g.node(u).op, Op::Opaque { .. }),
                        "{stem}: an opaque op uses all-reduce {}",
                        n.id
                    );
                }
            }
        }
        assert!(imp
            .notes
            .iter()
            .any(|n| n.starts_with("dropped") && n.contains("_assert_tensor_metadata")));
    }
}

// ---- .pt2 archives -------------------------------------------------------------------

fn zip_of(members: &[(&str, &[u8])], method: zip::CompressionMethod) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default().compression_method(method);
    for (name, data) in members {
        w.start_file(*name, opts).unwrap();
        w.write_all(data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

#[test]
fn pt2_archive_in_the_layout_torch_export_save_writes() {
    let json = export_bytes("llama31_8b_L2_tp8");
    let bare = import("llama31_8b_L2_tp8");
    for method in [
        zip::CompressionMethod::Stored,
        zip::CompressionMethod::Deflated,
    ] {
        let pt2 = zip_of(
            &[
                ("llama/archive_format", b"pt2"),
                ("llama/archive_version", b"0"),
                ("llama/models/model.json", &json),
                ("llama/data/weights/model_weights_config.json", b"{}"),
                ("llama/data/constants/model_constants_config.json", b"{}"),
                ("llama/data/sample_inputs/model.pt", b"\x80\x02"),
            ],
            method,
        );
        assert_eq!(detect(&pt2), Format::TorchExportPt2);
        let imp = load_any(&pt2).unwrap();
        assert_eq!(imp.graph.canonical_text(), bare.graph.canonical_text());
        assert_eq!(imp.notes, bare.notes);
    }
}

#[test]
fn pt2_archive_in_the_older_layout() {
    let json = export_bytes("gemma3_1b_L2_tp2");
    let pt2 = zip_of(
        &[
            ("serialized_exported_program.json", &json),
            ("serialized_state_dict.pt", b""),
            ("version", b"1"),
        ],
        zip::CompressionMethod::Stored,
    );
    let imp = torch_export::import(&pt2).unwrap();
    assert_eq!(
        imp.graph.canonical_text(),
        import("gemma3_1b_L2_tp2").graph.canonical_text()
    );
}
