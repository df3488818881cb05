//! `arfuse::splice` on the post-grad graphs torch.compile produced
//! (`ir-fixtures/postgrad/`): what a torch.compile pass changes in its FX graph.

use arfuse::advanced::import::{load_any, Imported};
use arfuse::advanced::ir::op::FusedOutput;
use arfuse::splice::{splice, SpliceError, SpliceInput};
use arfuse::Target;

fn postgrad(stem: &str) -> Imported {
    let path = format!(
        "{}/ir-fixtures/postgrad/{stem}_postgrad_pre.json.gz",
        env!("CARGO_MANIFEST_DIR")
    );
    load_any(&std::fs::read(&path).unwrap()).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn tp2() -> Target {
    Target::preset("h200-sxm-x2").unwrap()
}

#[test]
fn llama_post_grad_graph_splices_every_site_in_torch_names() {
    let imp = postgrad("llama_3_1_8b_instruct_L2_tp2");
    let lowered = arfuse::lower(&imp.graph, &tp2()).unwrap();
    let s = splice(&imp.graph, &imp.tensors, &lowered.graph).unwrap();
    assert!(s.skipped.is_empty(), "{:?}", s.skipped);
    // 2L + 1 sites: the embedding's all-reduce and two per layer, in graph order.
    let ars: Vec<&str> = s.sites.iter().map(|x| x.all_reduce.as_str()).collect();
    assert_eq!(
        ars,
        [
            "all_reduce",
            "all_reduce_1",
            "all_reduce_2",
            "all_reduce_3",
            "all_reduce_4"
        ]
    );
    for (k, site) in s.sites.iter().enumerate() {
        let a = &site.attrs;
        assert_eq!(a.group, "0");
        assert_eq!(a.eps, 1e-5);
        assert_eq!(a.norm_rounding.name(), "twice", "site {k}");
        assert_eq!(a.residual, k > 0, "site {k}");
        assert_eq!(site.inputs.len(), if k > 0 { 3 } else { 2 });
        // x is the all-reduce's input tensor, the weight a graph input.
        let SpliceInput::Tensor(x) = &site.inputs[0] else {
            panic!("site {k}: x is {:?}", site.inputs[0])
        };
        assert_eq!(
            imp.tensors[x],
            imp.graph
                .node(imp.graph.find(&site.all_reduce).unwrap())
                .inputs[0]
        );
        let SpliceInput::Tensor(w) = site.inputs.last().unwrap() else {
            panic!("site {k}: weight")
        };
        assert!(w.starts_with("arg"), "{w}");
        // The residual is the previous site's residual output.
        if k > 0 {
            let prev = &s.sites[k - 1];
            let res = prev
                .outputs
                .iter()
                .position(|p| p.output == FusedOutput::Residual)
                .unwrap();
            assert_eq!(
                site.inputs[1],
                SpliceInput::Site {
                    site: k - 1,
                    output: res
                }
            );
        }
        // The norm output has readers (the next projections, or the graph output).
        let norm = &site.outputs[0];
        assert_eq!(norm.output, FusedOutput::Norm);
        assert!(
            !(norm.replaces.is_empty() && norm.views.is_empty()),
            "site {k}"
        );
        for name in norm.replaces.iter().chain(&norm.views) {
            assert!(
                s.removed.contains(name),
                "{name} is replaced but not removed"
            );
        }
    }
    // The last site only writes the norm: the final residual has no reader.
    assert_eq!(s.sites[4].attrs.outputs, [FusedOutput::Norm]);
    assert_eq!(s.sites[4].outputs[0].replaces, ["mul_232"]);
    // Every all-reduce and the wait_tensor forwarded to it are no longer computed.
    for k in ["", "_1", "_2", "_3", "_4"] {
        for base in ["all_reduce", "wait_tensor"] {
            let name = format!("{base}{k}");
            assert!(s.removed.contains(&name), "{name}");
        }
    }
    // Nothing a kept node computes is removed: the projections' views stay.
    assert!(!s.removed.contains(&"view_15".to_string()));
}

#[test]
fn a_graph_that_is_not_the_lowered_graphs_original_is_refused() {
    let llama = postgrad("llama_3_1_8b_instruct_L2_tp2");
    let gemma = postgrad("gemma_3_1b_it_L2_tp2");
    let lowered = arfuse::lower(&gemma.graph, &tp2()).unwrap();
    let e = splice(&llama.graph, &llama.tensors, &lowered.graph).unwrap_err();
    assert!(
        matches!(e, SpliceError::Mismatch { .. } | SpliceError::Shape(_)),
        "{e}"
    );
    // A graph spliced with itself (nothing lowered) changes nothing.
    let s = splice(&llama.graph, &llama.tensors, &llama.graph).unwrap();
    assert!(s.sites.is_empty() && s.skipped.is_empty() && s.removed.is_empty());
}
