//! From the IR's fused node (`arfuse_ir::FusedAllReduceNorm` with the plan the pass
//! wrote) to what the runtime launches: the kernel variant per token count, the
//! workspace request, and the scalar arguments.
//!
//! The plan's dispatch ranges decide, for every T from 1 to the largest batched token
//! count, whether the call is one-shot, two-shot or unfused; [`NodeKernels::route`]
//! follows them exactly and refuses a T the plan does not cover, so a graph never
//! runs a strategy the planner did not prove fits.
//!
//! Workspace: exactly the one the plan carries ([`arfuse_policy::Workspace`], arfuse's
//! layout [`arfuse_policy::ArfuseLayout`]): the runtime allocates what the planner
//! proved, and re-checks every fused range with the policy's capacity rule
//! ([`arfuse_policy::Workspace::misfit`]) when the node is loaded.

use crate::error::{Error, Result};
use crate::variants::{self, ActDtype, Epilogue, KernelKind, Quant, Strategy, Variant};
use crate::workspace::Backend;
use arfuse_ir::{DType, FusedAllReduceNorm, FusedOutput, FusedQuant, Graph, Op};
use arfuse_policy::{ArfuseLayout, Workspace};

/// How one call of the node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The fused kernel (its strategy is in the variant).
    Fused(Variant),
    /// Unfused: the all-reduce by the collective library (NCCL on real ranks), then
    /// the `local` kernel (residual add, RMSNorm, quant) on the all-reduced tensor.
    Unfused {
        /// The local kernel.
        local: Variant,
    },
}

/// Everything the runtime needs to run one fused node.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeKernels {
    /// IR node id (for messages).
    pub node: String,
    /// World size W.
    pub world: u32,
    /// Activation dtype.
    pub dtype: ActDtype,
    /// Hidden size H (elements).
    pub hidden: u32,
    /// The epilogue (residual, RMSNorm, quant).
    pub epilogue: Epilogue,
    /// RMSNorm epsilon as the kernels take it (the f32 nearest the IR's f64).
    pub eps: f32,
    /// 0, or 1 for Gemma-style offset weights.
    pub weight_bias: f32,
    /// The RMSNorm weight is f32 (the Gemma form `1 + w.float()` with 16-bit
    /// activations), not the activation dtype.
    pub gamma_f32: bool,
    /// The RMSNorm rounds `h * r` to the activation dtype before the weight multiply
    /// (the node's `norm_rounding` is `twice`: the contract's clause 3).
    pub norm_round_twice: bool,
    /// The RMSNorm normalises the unrounded f32 sum of the all-reduce output and the
    /// residual (the node's `norm_input` is `f32_sum`: the contract's clauses 2-3).
    pub norm_f32_sum: bool,
    /// Outputs the node writes (the others are passed as null pointers).
    pub outputs: Vec<FusedOutput>,
    /// The plan's backend.
    pub backend: Backend,
    /// The plan's workspace: what the runtime allocates per rank (shared by the nodes
    /// that carry the same one).
    pub workspace: Workspace,
    dispatch: Vec<(u32, u32, Strategy)>,
}

fn activation_dtype(d: DType, node: &str) -> Result<ActDtype> {
    d.activation().ok_or_else(|| {
        Error::Unsupported(format!(
            "node {node}: activation dtype {d:?} has no fused kernel (bf16, f16, f32)"
        ))
    })
}

fn to_u32(v: u64, node: &str, what: &str) -> Result<u32> {
    u32::try_from(v)
        .map_err(|_| Error::Unsupported(format!("node {node}: {what} = {v} exceeds 2^32 - 1")))
}

/// The kernel quant form of an IR quant epilogue ([`FusedQuant::kernel_quant`]).
///
/// # Errors
/// [`Error::Unsupported`] for a per-token-group FP8 group size other than the ABI's
/// [`arfuse_abi::FP8_GROUP_SIZE`].
pub fn quant_of(q: FusedQuant, node: &str) -> Result<Quant> {
    q.kernel_quant()
        .map_err(|why| Error::Unsupported(format!("node {node}: per-token-group FP8: {why}")))
}

/// The plan's workspace must be arfuse's layout for this node's W and dtype, at least
/// as wide as its H.
fn node_workspace(node: &str, ws: &Workspace, world: u32, dt: ActDtype, hidden: u32) -> Result<()> {
    crate::device::arfuse_layout(ws)
        .map_err(|e| Error::Unsupported(format!("node {node}: {e}")))?;
    if ws.world_size != world || ws.dtype != dt || ws.hidden < u64::from(hidden) {
        return Err(Error::Invalid(format!(
            "node {node}: the plan's workspace is for W={} {} H<={}, the node is W={world} {} H={hidden}",
            ws.world_size,
            ws.dtype,
            ws.hidden,
            dt.name()
        )));
    }
    Ok(())
}

impl NodeKernels {
    /// Builds the launch description of a fused node with attributes `attrs`, id
    /// `node`, activation dtype `dtype`, hidden size `hidden` (elements), RMSNorm
    /// weight dtype `weight_dtype`, for world size `world`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the node has no plan, or its plan does not cover
    /// 1..=max tokens without gaps; [`Error::Unsupported`] for what the kernels do not
    /// implement (W outside {2, 4, 8, 16}, dtypes other than bf16/f16/f32, a weight
    /// dtype other than the activation's or f32 with `weight_bias` 1, a group size
    /// other than 128, NVFP4 on f32, `weight_bias` other than 0 or 1, a fused range
    /// whose variant is not built, a workspace that is not arfuse's layout for this W and
    /// dtype); [`Error::Invalid`] for a fused range the workspace's capacity rule refuses.
    pub fn new(
        node: &str,
        attrs: &FusedAllReduceNorm,
        dtype: DType,
        hidden: u64,
        weight_dtype: DType,
        world: u32,
    ) -> Result<NodeKernels> {
        let dt = activation_dtype(dtype, node)?;
        let hidden = to_u32(hidden, node, "hidden size")?;
        if let Some(why) = arfuse_abi::world_unsupported(world) {
            return Err(Error::Unsupported(format!("node {node}: {why}")));
        }
        let eps = attrs.eps as f32;
        if !(eps.is_finite() && eps > 0.0) {
            return Err(Error::Unsupported(format!(
                "node {node}: eps {:?} is not a positive finite f32 (the kernels take f32)",
                attrs.eps
            )));
        }
        let weight_bias = attrs.weight_bias;
        if weight_bias != 0.0 && weight_bias != 1.0 {
            return Err(Error::Unsupported(format!(
                "node {node}: weight_bias {weight_bias}; the kernels take 0 or 1"
            )));
        }
        // The weight is read in the activation dtype, or as f32 (Gemma's offset
        // weight `1 + w.float()`).
        if weight_dtype != dtype && weight_dtype != DType::F32 {
            return Err(Error::Unsupported(format!(
                "node {node}: RMSNorm weight is {weight_dtype:?} with {dtype:?} activations; the kernels read it as the activation dtype or f32"
            )));
        }
        let quant = quant_of(attrs.quant, node)?;
        if let Some(why) = quant.unsupported(u64::from(hidden), dt) {
            return Err(Error::Unsupported(format!("node {node}: {why}")));
        }
        let epilogue = Epilogue {
            residual: attrs.residual,
            norm: true,
            quant,
        };
        // The kernels' shape limits, checked when the node is loaded rather than at
        // its first launch (which may be inside a capture).
        crate::device::block_size(hidden, dt)
            .map_err(|e| Error::Unsupported(format!("node {node}: hidden size {hidden}: {e}")))?;
        let plan = attrs.plan.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "node {node}: the fused node carries no plan; lower the graph with a target first"
            ))
        })?;
        let workspace = plan.workspace.clone();
        node_workspace(node, &workspace, world, dt, hidden)?;
        let backend = plan.backend();
        let mut dispatch = Vec::with_capacity(plan.dispatch.len());
        let mut next = 1u64;
        for r in &plan.dispatch {
            if r.min_tokens != next || r.max_tokens < r.min_tokens {
                return Err(Error::Invalid(format!(
                    "node {node}: plan dispatch range {}..={} does not continue from T = {next}",
                    r.min_tokens, r.max_tokens
                )));
            }
            next = r.max_tokens.saturating_add(1);
            let lo = to_u32(r.min_tokens, node, "dispatch range start")?;
            let hi = to_u32(r.max_tokens, node, "dispatch range end")?;
            if hi > i32::MAX as u32 {
                return Err(Error::Unsupported(format!(
                    "node {node}: plan range ends at T = {hi}; the kernels take T < 2^31"
                )));
            }
            let strategy = r.strategy;
            if strategy.is_fused() {
                let s = strategy;
                // The planner's proof, re-checked with the same rule at both ends of
                // the range (it is monotone in T), so a plan edited by hand cannot run
                // a call its workspace does not hold.
                for t in [lo, hi] {
                    crate::device::check_fits(&workspace, s, t, hidden).map_err(|e| match e {
                        Error::Invalid(m) => {
                            Error::Invalid(format!("node {node}: plan range {lo}..={hi}: {m}"))
                        }
                        other => other,
                    })?;
                }
                let v = Variant {
                    kind: KernelKind::Fused { strategy: s, world },
                    dtype: dt,
                    epilogue,
                };
                if variants::find(v.kind, dt, epilogue).is_none() {
                    return Err(Error::Unsupported(format!(
                        "node {node}: no kernel variant {v} for T = {lo}..={hi}"
                    )));
                }
            }
            dispatch.push((lo, hi, strategy));
        }
        if dispatch.is_empty() {
            return Err(Error::Invalid(format!(
                "node {node}: the plan has no dispatch ranges"
            )));
        }
        Ok(NodeKernels {
            node: node.to_string(),
            world,
            dtype: dt,
            hidden,
            epilogue,
            eps,
            weight_bias: weight_bias as f32,
            gamma_f32: weight_dtype == DType::F32,
            norm_round_twice: attrs.norm_rounding == arfuse_ir::NormRounding::Twice,
            norm_f32_sum: attrs.norm_input == arfuse_ir::NormInput::F32Sum,
            outputs: attrs.outputs.clone(),
            backend,
            workspace,
            dispatch,
        })
    }

    /// [`NodeKernels::new`] for node `id` of `graph`: the activation dtype and hidden
    /// size come from its `x` input (the last dimension must be a constant), the weight
    /// dtype from its weight input.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `id` is not a fused node of the graph or its hidden size
    /// is symbolic; then as [`NodeKernels::new`].
    pub fn from_graph(graph: &Graph, id: &str, world: u32) -> Result<NodeKernels> {
        let nid = graph
            .find(id)
            .ok_or_else(|| Error::Invalid(format!("no node {id:?} in the graph")))?;
        let node = graph.node(nid);
        let Op::FusedAllreduceNorm(attrs) = &node.op else {
            return Err(Error::Invalid(format!(
                "node {id} is not a fused all-reduce node"
            )));
        };
        let ty = |k: usize, what: &str| {
            node.inputs
                .get(k)
                .and_then(|v| graph.value_type(*v))
                .ok_or_else(|| Error::Invalid(format!("node {id}: missing {what} input")))
        };
        if let Some(w) = graph.recorded_world_size() {
            if w != u64::from(world) {
                return Err(Error::Invalid(format!(
                    "node {id}: the graph was built for world size {w}, not {world}"
                )));
            }
        }
        let x = ty(0, "x")?;
        let weight = ty(if attrs.residual { 2 } else { 1 }, "weight")?;
        let hidden = x.shape.last().and_then(|d| d.as_const()).ok_or_else(|| {
            Error::Invalid(format!(
                "node {id}: the hidden (last) dimension of x is not a constant"
            ))
        })?;
        let k = NodeKernels::new(id, attrs, x.dtype, hidden, weight.dtype, world)?;
        // Every token count the graph can run with is in the plan: the largest value
        // of x's leading dims under the symbol ranges.
        let rows = x.shape.0[..x.shape.0.len().saturating_sub(1)]
            .iter()
            .try_fold(1u64, |acc, d| {
                d.max_value(graph.symbols())
                    .and_then(|v| acc.checked_mul(v))
            });
        let last = k.dispatch.last().map_or(0, |r| u64::from(r.1));
        if let Some(rows) = rows {
            if rows > last {
                return Err(Error::Invalid(format!(
                    "node {id}: the graph runs up to T = {rows} tokens but the plan ends at T = {last}"
                )));
            }
        }
        Ok(k)
    }

    /// How a call of `tokens` tokens runs.
    ///
    /// # Errors
    /// [`Error::Invalid`] for T = 0 or a T beyond the plan's last range (the plan
    /// covers every T the graph can run with; anything else is a caller error).
    pub fn route(&self, tokens: u32) -> Result<Route> {
        let hit = self
            .dispatch
            .iter()
            .find(|(lo, hi, _)| (*lo..=*hi).contains(&tokens))
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "node {}: T = {tokens} is outside the plan (1..={})",
                    self.node,
                    self.dispatch.last().map_or(0, |r| r.1)
                ))
            })?;
        Ok(match hit.2 {
            Strategy::Unfused => Route::Unfused {
                local: self.local_variant(),
            },
            strategy => Route::Fused(Variant {
                kind: KernelKind::Fused {
                    strategy,
                    world: self.world,
                },
                dtype: self.dtype,
                epilogue: self.epilogue,
            }),
        })
    }

    /// The local kernel of the unfused path (residual add, RMSNorm, quant on the
    /// all-reduced tensor).
    pub fn local_variant(&self) -> Variant {
        Variant {
            kind: KernelKind::Local,
            dtype: self.dtype,
            epilogue: self.epilogue,
        }
    }

    /// The byte layout of this node's workspace (per rank), as the runtime allocates
    /// it; checked by the constructor.
    ///
    /// # Errors
    /// As [`crate::device::arfuse_layout`].
    pub fn layout(&self) -> Result<ArfuseLayout> {
        crate::device::arfuse_layout(&self.workspace)
    }

    /// Whether an output is live.
    pub fn writes(&self, output: FusedOutput) -> bool {
        self.outputs.contains(&output)
    }

    /// The dispatch ranges: `(first T, last T, strategy)`.
    pub fn dispatch(&self) -> &[(u32, u32, Strategy)] {
        &self.dispatch
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arfuse_ir::{DispatchRange, FusedPlan, GroupScaleLayout};

    fn range(lo: u64, hi: u64, s: arfuse_ir::Strategy) -> DispatchRange {
        DispatchRange {
            min_tokens: lo,
            max_tokens: hi,
            strategy: s,
            required_bytes: 0,
        }
    }

    /// The seed case of domain.md section 5: W=8, H=6144, bf16, M=42, one-shot 1..=10,
    /// two-shot 11..=42, unfused above.
    fn seed() -> FusedAllReduceNorm {
        use arfuse_ir::Strategy as S;
        FusedAllReduceNorm {
            group: "tp".into(),
            eps: 1e-5,
            weight_bias: 0.0,
            norm_rounding: arfuse_ir::NormRounding::Once,
            norm_input: arfuse_ir::NormInput::Residual,
            residual: true,
            quant: FusedQuant::None,
            outputs: vec![FusedOutput::Norm, FusedOutput::Residual],
            plan: Some(FusedPlan {
                pattern_code: 1,
                max_token_num: 42,
                workspace: Workspace::arfuse(
                    arfuse_policy::Backend::Mnnvl,
                    8,
                    6144,
                    arfuse_policy::ActDtype::Bf16,
                    Some(42),
                    1_179_648,
                )
                .unwrap(),
                dispatch: vec![
                    range(1, 10, S::OneShot),
                    range(11, 42, S::TwoShot),
                    range(43, 8192, S::Unfused),
                ],
            }),
        }
    }

    #[test]
    fn seed_plan_routes_every_token_count_as_planned() {
        let k = NodeKernels::new("ln", &seed(), DType::Bf16, 6144, DType::Bf16, 8).unwrap();
        assert_eq!(k.backend, Backend::Mnnvl);
        let strategy = |t| match k.route(t).unwrap() {
            Route::Fused(v) => match v.kind {
                KernelKind::Fused { strategy, world } => {
                    assert_eq!(world, 8);
                    Some(strategy)
                }
                _ => unreachable!(),
            },
            Route::Unfused { local } => {
                assert_eq!(local.kind, KernelKind::Local);
                None
            }
        };
        assert_eq!(strategy(1), Some(Strategy::OneShot));
        assert_eq!(strategy(10), Some(Strategy::OneShot));
        assert_eq!(strategy(11), Some(Strategy::TwoShot));
        assert_eq!(strategy(40), Some(Strategy::TwoShot));
        assert_eq!(strategy(42), Some(Strategy::TwoShot));
        assert_eq!(strategy(43), None);
        assert!(k.route(0).is_err());
        let e = k.route(8193).unwrap_err().to_string();
        assert!(e.contains("node ln") && e.contains("8193"), "{e}");
        // The plan's workspace is what is allocated: 256 + 3 x 1,179,648 bytes per rank,
        // one buffer holding one-shot to T = 12 and two-shot to T = 48.
        let l = k.layout().unwrap();
        assert_eq!(l.bytes_per_rank, 3_539_200);
        assert_eq!(l.bytes_per_rank, k.workspace.total_bytes_per_rank);
        let fits = |s, t| crate::device::check_fits(&k.workspace, s, t, 6144).is_ok();
        assert!(fits(Strategy::OneShot, 12) && !fits(Strategy::OneShot, 13));
        assert!(fits(Strategy::TwoShot, 48) && !fits(Strategy::TwoShot, 49));
        assert_eq!(k.eps, 1e-5f32);
        assert!(k.writes(FusedOutput::Residual) && !k.writes(FusedOutput::Quant));
    }

    #[test]
    fn unsupported_and_invalid_nodes_are_errors_naming_the_node() {
        let s = seed();
        let err = |a: &FusedAllReduceNorm, d: DType, w: DType, world: u32| {
            NodeKernels::new("n7", a, d, 6144, w, world)
                .unwrap_err()
                .to_string()
        };
        assert!(err(&s, DType::Bf16, DType::Bf16, 6).contains("world size 6"));
        assert!(err(&s, DType::Fp8E4m3, DType::Bf16, 8).contains("n7"));
        assert!(err(&s, DType::Bf16, DType::F16, 8).contains("weight"));
        let gemma = NodeKernels::new("g", &s, DType::Bf16, 6144, DType::F32, 8).unwrap();
        assert!(gemma.gamma_f32);
        let mut g = s.clone();
        g.quant = FusedQuant::Fp8PerTokenGroup {
            group_size: 64,
            scale_layout: GroupScaleLayout::PackedUe8m0,
        };
        assert!(err(&g, DType::Bf16, DType::Bf16, 8).contains("groups of 128 elements, not 64"));
        let mut n = s.clone();
        n.quant = FusedQuant::Nvfp4 {
            scale_layout: arfuse_abi::Nvfp4ScaleLayout::Linear,
        };
        assert!(err(&n, DType::F32, DType::F32, 8).contains("not defined for f32"));
        let mut no_plan = s.clone();
        no_plan.plan = None;
        assert!(err(&no_plan, DType::Bf16, DType::Bf16, 8).contains("no plan"));
        let mut gap = s.clone();
        gap.plan.as_mut().unwrap().dispatch.remove(1);
        assert!(err(&gap, DType::Bf16, DType::Bf16, 8).contains("does not continue from T = 11"));
        let mut wb = s.clone();
        wb.weight_bias = 0.5;
        assert!(err(&wb, DType::Bf16, DType::Bf16, 8).contains("weight_bias"));
        let mut tiny = s.clone();
        tiny.eps = 1e-50;
        assert!(err(&tiny, DType::Bf16, DType::Bf16, 8).contains("eps 1e-50"));
        // A one-shot range the plan's Lamport buffer cannot hold (edited by hand).
        let mut over = s.clone();
        // (T = 12 fills the 1,179,648-byte buffer exactly; T = 13 needs 1,277,952.)
        over.plan.as_mut().unwrap().dispatch[0].max_tokens = 13;
        over.plan.as_mut().unwrap().dispatch[1].min_tokens = 14;
        let e = err(&over, DType::Bf16, DType::Bf16, 8);
        assert!(e.contains("T = 13") && e.contains("1277952 bytes"), "{e}");
        // Shape limits of the kernels, at load time.
        let wide = NodeKernels::new("w", &s, DType::Bf16, 65536, DType::Bf16, 8).unwrap_err();
        assert!(
            wide.to_string().contains("node w: hidden size 65536"),
            "{wide}"
        );
        let mut grp = s;
        grp.quant = FusedQuant::Fp8PerTokenGroup {
            group_size: 128,
            scale_layout: GroupScaleLayout::F32RowMajor,
        };
        let e = NodeKernels::new("q", &grp, DType::Bf16, 2880, DType::Bf16, 8).unwrap_err();
        assert!(e.to_string().contains("multiple of 128"), "{e}");
    }

    #[test]
    fn every_group_scale_form_maps_to_its_kernel() {
        // The IR's form is carried into the kernel variant unchanged (one definition).
        for layout in GroupScaleLayout::ALL {
            let q = FusedQuant::Fp8PerTokenGroup {
                group_size: 128,
                scale_layout: layout,
            };
            assert_eq!(quant_of(q, "n").unwrap(), Quant::Fp8Group(layout));
            let mut a = seed();
            a.quant = q;
            let k = NodeKernels::new("g", &a, DType::Bf16, 6144, DType::Bf16, 8).unwrap();
            assert_eq!(k.epilogue.quant, Quant::Fp8Group(layout));
        }
        assert_eq!(
            Quant::Fp8Group(GroupScaleLayout::F32RowMajorUe8m0).name(),
            "fp8grp_f32_ue8m0"
        );
    }

    #[test]
    fn a_plan_too_large_for_one_shot_fails_at_load_time() {
        use arfuse_ir::Strategy as S;
        // One-shot up to T = 8192 at W = 8, H = 16384, bf16 needs 2 GiB of one buffer,
        // above the largest buffer the kernels allow: refused when the node is loaded,
        // not at launch.
        let mut a = seed();
        let plan = a.plan.as_mut().unwrap();
        plan.workspace = Workspace::arfuse(
            arfuse_policy::Backend::Mnnvl,
            8,
            16384,
            arfuse_policy::ActDtype::Bf16,
            None,
            arfuse_policy::LAMPORT_MAX_COMM_BYTES,
        )
        .unwrap();
        plan.dispatch = vec![range(1, 8192, S::OneShot)];
        let e = NodeKernels::new("big", &a, DType::Bf16, 16384, DType::Bf16, 8)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "invalid argument: node big: plan range 1..=8192: one-shot at \
             T = 8192 needs 2147483648 bytes of one Lamport buffer; it has 2145386496"
        );
        // A plan for FlashInfer's kernels is not this runtime's to run.
        let mut fi = seed();
        fi.plan.as_mut().unwrap().workspace =
            Workspace::flashinfer_mnnvl(8, 6144, arfuse_policy::ActDtype::Bf16, 42).unwrap();
        let e = NodeKernels::new("fi", &fi, DType::Bf16, 6144, DType::Bf16, 8)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("node fi") && e.contains("flashinfer's kernels"),
            "{e}"
        );
    }
}
