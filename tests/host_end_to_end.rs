//! End to end on the host device: a corpus model (Llama-3.1-8B, two decoder layers,
//! TP 8, built from `ir-fixtures/configs` by `arfuse-models`) lowered for h200-sxm-x8,
//! then every fused node of the lowered graph run through the public
//! `arfuse_runtime::runner::Runner` on `arfuse_runtime::host::HostDevice` (the real
//! kernel sources on the CPU, every rank its own launch stream) at both ends of every
//! range of its plan (one-shot, two-shot, unfused), and compared with what
//! arfuse-reference's evaluator computes for that node (the node cut out of the graph
//! with its inputs, `arfuse_reference::evaluate`, on the GPU check's inputs): the
//! kernels' outputs bit-exact against the contract in the kernels' sum order
//! (`arfuse_runtime::check::{expected_with_eps, compare}`, the node's eps), and that contract against the
//! evaluator (the same residual bits, the norm within 1 ulp: the evaluator sums the
//! squares in the IR's sequential order). The node's dead outputs
//! (those the lowered graph does not list) are passed as null and must stay untouched.

use arfuse::advanced::ir::{Graph, InputKind, Node, Op, TensorType, Value};
use arfuse::advanced::reference::{evaluate, Tensor};
use arfuse::Target;
use arfuse_runtime::check::{self, Case, Inputs, RankOutputs, FILL_BYTE};
use arfuse_runtime::device::{Allocation, Device, RankTensor};
use arfuse_runtime::host::{Compiler, HostDevice, HostMem, HostOptions};
use arfuse_runtime::node::{NodeKernels, Route};
use arfuse_runtime::runner::{NodeTensors, Runner};
use arfuse_runtime::variants::{ActDtype, Strategy};
use std::sync::Arc;
use std::time::Instant;

const WORLD: u32 = 8;

/// The 2-layer Llama-3.1-8B TP8 graph, lowered for h200-sxm-x8.
fn lowered_llama() -> Graph {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(
        root.join("ir-fixtures/configs/meta-llama__Llama-3.1-8B-Instruct.json"),
    )
    .expect("config");
    let config: serde_json::Value = serde_json::from_str(&text).expect("json");
    let opts = arfuse_models::BuildOptions {
        layers: Some(2),
        ..arfuse_models::BuildOptions::tp(WORLD)
    };
    let graph = arfuse_models::build(&config, &opts).expect("builds");
    let target = Target::preset("h200-sxm-x8").expect("preset");
    arfuse::lower(&graph, &target).expect("lowers").graph
}

/// Node `id` of `graph` alone: its inputs as graph inputs (x and residual per rank,
/// the weight a parameter), the node, its outputs as the graph's outputs.
fn node_alone(graph: &Graph, id: &str) -> Graph {
    let node = graph.node(graph.find(id).expect("node"));
    let mut g = Graph::new();
    for (name, range) in graph.symbols() {
        g.set_symbol(name.clone(), *range);
    }
    let Op::FusedAllreduceNorm(attrs) = &node.op else {
        panic!("{id} is not fused")
    };
    let mut names = vec!["x"];
    if attrs.residual {
        names.push("residual");
    }
    names.push("weight");
    assert_eq!(node.inputs.len(), names.len(), "{id}: a quant scale input");
    let mut inputs = Vec::new();
    for (k, name) in names.iter().enumerate() {
        let ty: TensorType = graph.value_type(node.inputs[k]).expect("type").clone();
        let kind = if *name == "weight" {
            InputKind::Parameter
        } else {
            InputKind::Activation
        };
        let n = g
            .add_node(Node {
                id: name.to_string(),
                op: Op::Input { kind },
                inputs: vec![],
                outputs: vec![ty],
                module: None,
            })
            .expect("input");
        inputs.push(Value::new(n, 0));
    }
    let f = g
        .add_node(Node {
            id: id.to_string(),
            op: node.op.clone(),
            inputs,
            outputs: node.outputs.clone(),
            module: None,
        })
        .expect("node");
    g.set_outputs(
        (0..node.outputs.len() as u32)
            .map(|k| Value::new(f, k))
            .collect(),
    )
    .expect("outputs");
    g
}

/// The reference's outputs of the node alone for `inputs`, as the kernels lay them out
/// (outputs the node does not list stay empty).
fn reference_outputs(
    alone: &Graph,
    k: &NodeKernels,
    case: &Case,
    inputs: &Inputs,
) -> Vec<RankOutputs> {
    let dt = |d: ActDtype| match d {
        ActDtype::Bf16 => arfuse::advanced::ir::DType::Bf16,
        ActDtype::F16 => arfuse::advanced::ir::DType::F16,
        ActDtype::F32 => arfuse::advanced::ir::DType::F32,
    };
    let (t, h) = (case.tokens as usize, case.hidden as usize);
    let tensor = |d: ActDtype, shape: Vec<usize>, bytes: &[u8]| {
        Tensor::from_f32(dt(d), shape, check::decode(d, bytes)).expect("tensor")
    };
    let mut rank_inputs = arfuse::advanced::reference::RankInputs::new();
    rank_inputs.insert(
        "x".into(),
        inputs
            .x
            .iter()
            .map(|b| tensor(case.dtype, vec![t, h], b))
            .collect(),
    );
    if case.epilogue.residual {
        rank_inputs.insert(
            "residual".into(),
            inputs
                .residual
                .iter()
                .map(|b| tensor(case.dtype, vec![t, h], b))
                .collect(),
        );
    }
    let gamma = tensor(check::gamma_dtype(case), vec![h], &inputs.gamma);
    rank_inputs.insert("weight".into(), vec![gamma; WORLD as usize]);
    let bindings =
        arfuse::advanced::reference::bind_tokens(alone, u64::from(case.tokens)).expect("bind");
    let eval = evaluate(alone, WORLD, &bindings, &rank_inputs).expect("evaluates");
    (0..WORLD as usize)
        .map(|r| {
            let mut o = RankOutputs::default();
            for (i, which) in k.outputs.iter().enumerate() {
                let bytes = eval.outputs[i][r].physical_bytes().expect("bytes");
                match which {
                    arfuse::advanced::ir::FusedOutput::Norm => o.out = bytes,
                    arfuse::advanced::ir::FusedOutput::Residual => o.residual_out = bytes,
                    arfuse::advanced::ir::FusedOutput::Quant => o.quant = bytes,
                    arfuse::advanced::ir::FusedOutput::Scale => o.scale = bytes,
                }
            }
            o
        })
        .collect()
}

/// One rank-strided tensor of `bytes` per rank (0: none).
struct Strided {
    mem: HostMem,
    bytes: u64,
}

impl Strided {
    fn new(dev: &mut HostDevice, bytes: u64) -> Strided {
        Strided {
            mem: dev.alloc(bytes.max(16) * u64::from(WORLD)).expect("alloc"),
            bytes: bytes.max(16),
        }
    }
    fn tensor(&self, live: bool) -> RankTensor {
        if live {
            RankTensor {
                ptr: self.mem.ptr(),
                rank_stride: self.bytes,
            }
        } else {
            RankTensor::default()
        }
    }
    fn upload(&self, dev: &mut HostDevice, per_rank: &[Vec<u8>]) {
        for (r, b) in per_rank.iter().enumerate() {
            dev.upload(&self.mem, r as u64 * self.bytes, b)
                .expect("upload");
        }
    }
    /// The first `n` bytes of each rank's slice when `live`, else an empty vector after
    /// checking the slice still holds its fill.
    fn read(&self, dev: &mut HostDevice, n: u64, live: bool) -> Vec<Vec<u8>> {
        (0..u64::from(WORLD))
            .map(|r| {
                let mut v = vec![0u8; self.bytes as usize];
                dev.download(&self.mem, r * self.bytes, &mut v)
                    .expect("download");
                if live {
                    v.truncate(n as usize);
                    v
                } else {
                    assert!(
                        v.iter().all(|&b| b == FILL_BYTE),
                        "a dead output was written"
                    );
                    Vec::new()
                }
            })
            .collect()
    }
}

#[test]
fn every_fused_node_of_a_lowered_llama_runs_on_the_host_device_as_the_reference_says() {
    let t0 = Instant::now();
    let lowered = lowered_llama();
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("arfuse-host");
    let compiler = Arc::new(Compiler::new(dir).expect("a C++ compiler (g++, or CXX)"));
    let mut runner = Runner::for_graph(
        HostDevice::new(compiler, HostOptions::default()),
        &lowered,
        WORLD,
    )
    .expect("runner");
    let ids: Vec<String> = runner.node_ids().map(str::to_string).collect();
    // Two layers: embedding -> layer 0 input norm, then two sites per layer.
    assert_eq!(ids.len(), 5, "{ids:?}");
    let prepared = runner.prepare().expect("prepare");
    // The plan asks for mnnvl; W ranks of one machine fall back to trtllm, as on one GPU.
    assert!(
        prepared.iter().all(|(_, p)| *p
            == arfuse_runtime::runner::Prepared::Fused(arfuse_runtime::workspace::Backend::Trtllm)),
        "{prepared:?}"
    );
    assert_eq!(
        runner.workspaces(),
        1,
        "every node shares the plan's one workspace"
    );
    let k0 = runner.kernels(&ids[0]).expect("node").clone();
    // Both ends of every range of the plan; the unfused range only at its start and at
    // 128 (8192 tokens on the CPU would take minutes).
    let mut tokens = Vec::new();
    for &(lo, hi, s) in k0.dispatch() {
        tokens.push(lo);
        tokens.push(if s.is_fused() { hi } else { hi.min(128) });
    }
    assert_eq!(
        tokens,
        [1, 16, 17, 64, 65, 128],
        "the h200-sxm-x8 plan of Llama-3.1-8B"
    );
    let max_t = *tokens.iter().max().expect("tokens");
    let act = u64::from(max_t) * u64::from(k0.hidden) * k0.dtype.element_bytes();
    let dev = runner.device();
    let (x, res, out, res_out) = (
        Strided::new(dev, act),
        Strided::new(dev, act),
        Strided::new(dev, act),
        Strided::new(dev, act),
    );
    let gamma = dev.alloc(u64::from(k0.hidden) * 4).expect("alloc");
    let mut failures = Vec::new();
    let mut runs = 0;
    for id in &ids {
        let k = runner.kernels(id).expect("node").clone();
        assert!(
            k.epilogue.quant == arfuse_runtime::variants::Quant::None,
            "{id}"
        );
        assert!(
            k.writes(arfuse::advanced::ir::FusedOutput::Norm),
            "{id}: nothing to compare"
        );
        let alone = node_alone(&lowered, id);
        let live = |o| k.writes(o);
        for &t in &tokens {
            let strategy = match k.route(t).expect("route") {
                Route::Fused(v) => match v.kind {
                    arfuse_runtime::variants::KernelKind::Fused { strategy, .. } => strategy,
                    _ => unreachable!(),
                },
                Route::Unfused { .. } => Strategy::OneShot,
            };
            let case = Case {
                strategy,
                world: WORLD,
                dtype: k.dtype,
                epilogue: k.epilogue,
                tokens: t,
                hidden: k.hidden,
                weight_bias: k.weight_bias as u32,
                gamma_f32: k.gamma_f32,
                norm_round_twice: k.norm_round_twice,
                norm_f32_sum: k.norm_f32_sum,
            };
            let inputs = check::make_inputs(&case, 0x11a ^ u64::from(t)).expect("inputs");
            // The evaluator sums the RMSNorm squares sequentially (the IR's order), the
            // kernels in their block tree (`SumOrder::KernelTree`): the kernels are held
            // bit-exactly to the contract in their order (`check::expected`), and that
            // contract to the evaluator: the same residual bits, the norm within 1 ulp.
            let evaluated = reference_outputs(&alone, &k, &case, &inputs);
            let want = check::expected_with_eps(&case, &inputs, f64::from(k.eps))
                .expect("expected outputs");
            // Only the outputs the lowered graph reads are written (as the evaluator's).
            let want: Vec<RankOutputs> = want
                .into_iter()
                .map(|w| RankOutputs {
                    out: if live(arfuse::advanced::ir::FusedOutput::Norm) {
                        w.out
                    } else {
                        Vec::new()
                    },
                    residual_out: if live(arfuse::advanced::ir::FusedOutput::Residual) {
                        w.residual_out
                    } else {
                        Vec::new()
                    },
                    ..w
                })
                .collect();
            let agree = check::compare(&case, &inputs, &want, &evaluated).expect("compare");
            if agree.exact_mismatches != 0 || agree.size_mismatches != 0 || agree.max_norm_ulp > 1 {
                failures.push(format!(
                    "{id} T={t}: the evaluator and the kernel-order contract disagree: {} (norm up to {} ulp)",
                    agree.summary(),
                    agree.max_norm_ulp
                ));
            }
            let dev = runner.device();
            x.upload(dev, &inputs.x);
            res.upload(dev, &inputs.residual);
            dev.upload(&gamma, 0, &inputs.gamma).expect("upload");
            for s in [&out, &res_out] {
                dev.fill(&s.mem, 0, s.mem.bytes(), FILL_BYTE).expect("fill");
            }
            let norm = live(arfuse::advanced::ir::FusedOutput::Norm);
            let resid = live(arfuse::advanced::ir::FusedOutput::Residual);
            let tensors = NodeTensors {
                x: x.tensor(true),
                residual_in: res.tensor(k.epilogue.residual),
                residual_out: res_out.tensor(resid),
                out: out.tensor(norm),
                gamma: gamma.ptr(),
                ..NodeTensors::default()
            };
            runner.launch(id, t, &tensors).expect("launch");
            runner.sync().expect("sync");
            let n = case.output_bytes().expect("sizes").out;
            let dev = runner.device();
            let (o, r) = (out.read(dev, n, norm), res_out.read(dev, n, resid));
            let got: Vec<RankOutputs> = (0..WORLD as usize)
                .map(|q| RankOutputs {
                    out: o[q].clone(),
                    residual_out: r[q].clone(),
                    ..RankOutputs::default()
                })
                .collect();
            let v = check::compare(&case, &inputs, &want, &got).expect("compare");
            runs += 1;
            if !v.passed() {
                failures.push(format!(
                    "{id} T={t}: {} (norm up to {} ulp)",
                    v.summary(),
                    v.max_norm_ulp
                ));
            }
        }
    }
    println!(
        "Llama-3.1-8B (2 layers, TP 8, h200-sxm-x8): {} fused nodes x {} T = {runs} calls on the host device in {:.1} s",
        ids.len(),
        tokens.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
