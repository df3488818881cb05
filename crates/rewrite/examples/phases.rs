#[path = "../tests/common/builder.rs"]
mod builder;
use builder::{NormForm, Stack};
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let norm = match a.get(2).map(|s| s.as_str()) {
        Some("rms") => NormForm::RmsNorm,
        Some("farn") => NormForm::FusedAdd,
        _ => NormForm::Decomposed,
    };
    let target = arfuse_policy::Target::preset("h200-sxm-x8").unwrap();
    if a[1] == "maxnodes" {
        let g = max_nodes_graph();
        for _ in 0..3 {
            let t = std::time::Instant::now();
            let l = arfuse_rewrite::lower(&g, &target).unwrap();
            let e = t.elapsed().as_secs_f64();
            println!("max_nodes {} nodes: {:.3} s, {:.1} us/site", g.len(), e, e * 1e6 / l.report.all_reduces_fused as f64);
        }
        return;
    }
    for layers in a[1].split(',').map(|s| s.parse::<usize>().unwrap()) {
        let runs = std::env::var("RUNS")
            .map(|r| r.parse().unwrap())
            .unwrap_or((2_000_000 / (layers * 30)).clamp(3, 200));
        let g = Stack {
            layers,
            norm,
            ..Stack::default()
        }
        .build();
        let mut best = f64::MAX;
        let mut sites = 0;
        for _ in 0..runs {
            let t = std::time::Instant::now();
            let mut o = arfuse_rewrite::LowerOptions::default();
            if let Ok(w) = std::env::var("WIN") {
                o.window_nodes = w.parse().unwrap();
            }
            let l = arfuse_rewrite::lower_with(&g, &target, &o).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
            sites = l.report.all_reduces_fused;
            drop(l);
        }
        println!(
            "{layers:5} layers {:?}: best {:8.2} ms, {:6.1} us/site",
            norm,
            best * 1e3,
            best * 1e6 / sites as f64
        );
    }
}

fn max_nodes_graph() -> arfuse_ir::Graph {
    use arfuse_ir::{DType, Dim, Graph, InputKind, Node, Op, TensorType, Value};
    let mut g = Graph::new();
    g.set_symbol("T", arfuse_ir::SymbolRange { min: 1, max: 8192 });
    let act = || TensorType::new(DType::Bf16, vec![Dim::symbol("T"), Dim::constant(4096)]);
    let mut add = |id: String, op: Op, inputs: Vec<Value>, outputs: Vec<TensorType>| {
        g.add_node(Node { id, op, inputs, outputs, module: None }).expect("a valid node")
    };
    let x = add("x".into(), Op::Input { kind: InputKind::Activation }, vec![], vec![act()]);
    let w = add("w".into(), Op::Input { kind: InputKind::Parameter }, vec![], vec![TensorType::new(DType::Bf16, vec![Dim::constant(4096)])]);
    let (mut prev, mut res) = (Value::new(x, 0), Value::new(x, 0));
    for i in 0..(arfuse_ir::MAX_NODES - 2) / 3 {
        let ar = add(format!("ar{i}"), Op::AllReduce { group: "tp".into(), reduce: Default::default() }, vec![prev], vec![act()]);
        let n = add(format!("n{i}"), Op::FusedAddRmsNorm { eps: 1e-6, weight_bias: 0.0 }, vec![Value::new(ar, 0), res, Value::new(w, 0)], vec![act(), act()]);
        let a = add(format!("attn{i}"), Op::Opaque { target: "attention".into(), attrs: serde_json::Value::Null }, vec![Value::new(n, 0)], vec![act()]);
        prev = Value::new(a, 0);
        res = Value::new(n, 1);
    }
    g.set_outputs(vec![prev, res]).expect("valid outputs");
    g
}
