//! Running the fused nodes of a lowered graph on a [`Device`]: the workspace from the
//! plan with the fallback chain, the route of every token count, the unfused path,
//! one captured graph per capture size, and the kernels' error words.
//!
//! Order of use: [`Runner::for_graph`] or [`Runner::new`] + [`Runner::add`] (nothing on
//! the device yet), [`Runner::prepare`] outside any capture (creates the workspace, or
//! records why none could be made, and loads every kernel any token count of the plan
//! can route to), then [`Runner::launch`] or [`Runner::capture`] + [`Runner::replay`]
//! (per node) as often as needed: they never allocate, compile or retry a failed
//! backend, so they are safe inside a capture. Launches are enqueued on the device;
//! [`Runner::sync`] waits for them and reports a kernel that gave up waiting for a peer
//! (its error word) as an error naming the node.
//!
//! The runner does not know which device it has: the same code runs on a GPU
//! ([`crate::cuda::Gpu`]; NOT YET RUN ON ONE, see `cuda`'s module note) and on the CPU
//! ([`crate::host::HostDevice`], where the tests run it).

use crate::device::{self, Device, FusedCall, KernelParams, RankTensor};
use crate::error::{Error, Result};
use crate::node::{NodeKernels, Route};
use crate::variants::{self, Variant};
use crate::workspace::{Acquired, Backend, Fallback, WorkspaceManager};
use std::collections::BTreeMap;

/// The tensors of one call, each with one slice per virtual rank (`ptr + r *
/// rank_stride`, the stride in bytes, at least the largest T's slice); a zero `ptr`
/// marks a dead output (pass null for the outputs the node does not list). `gamma` is
/// `[H]` in the activation dtype, or f32 when [`NodeKernels::gamma_f32`]; `scale_in`
/// is the device address of the fp32 static-FP8 or NVFP4 global scale (required for
/// those quants, 0 otherwise). In-place use: the fused kernels allow an output to alias
/// its own input (`out == x`, `residual_out == residual_in`); the unfused path needs
/// the norm or the residual output to overlap neither `x` nor `residual_in`, and
/// returns an error otherwise.
#[derive(Debug, Clone, Copy, Default)]
pub struct NodeTensors {
    /// All-reduce input `[T, H]` per rank.
    pub x: RankTensor,
    /// Residual input `[T, H]` per rank (when the node adds one).
    pub residual_in: RankTensor,
    /// New residual `[T, H]` per rank.
    pub residual_out: RankTensor,
    /// RMSNorm output `[T, H]` per rank.
    pub out: RankTensor,
    /// Quant data per rank.
    pub quant_out: RankTensor,
    /// Quant scales per rank, in their physical layout, padding included (larger than
    /// the IR's logical scale shape): packed UE8M0 `(T + (ceil(H / 512) - 1) *
    /// round_up(T, 4)) * 4` bytes (vLLM's allocation; the kernels write nothing past
    /// it), swizzled NVFP4 `round_up(T, 128) * round_up(H / 16, 4)` bytes
    /// (`arfuse_reference::numerics::quant::{group_scale_bytes, nvfp4_scale_bytes}`;
    /// `check::Case::output_bytes` gives every output's size).
    pub scale_out: RankTensor,
    /// RMSNorm weight address.
    pub gamma: u64,
    /// fp32 scalar address.
    pub scale_in: u64,
}

/// What [`Runner::prepare`] settled on for a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    /// Fused ranges run fused with this backend's workspace.
    Fused(Backend),
    /// No fused backend could be created; every call runs unfused. One reason per
    /// backend tried.
    Unfused(Vec<String>),
}

/// One node's state in a [`Runner`].
struct NodeState {
    kernels: NodeKernels,
    chain: Vec<Fallback>,
    prepared: Option<Prepared>,
}

/// Runs the fused nodes of a graph on the W ranks of a [`Device`]. Nodes whose plans
/// carry the same workspace (every fused node of one group and dtype, as the planner
/// sizes one workspace for them) share ONE allocation of exactly that workspace; all
/// launches go to the device in call order.
pub struct Runner<D: Device> {
    manager: WorkspaceManager<D>,
    nodes: BTreeMap<String, NodeState>,
    /// Nodes launched or replayed since the last [`Runner::sync`], in first-launch order.
    pending: Vec<String>,
}

/// One captured graph per capture size of one node ([`Runner::capture`]).
pub struct Captures<D: Device> {
    node: String,
    graphs: BTreeMap<u32, D::Graph>,
}

impl<D: Device> Captures<D> {
    /// The node the graphs run.
    pub fn node(&self) -> &str {
        &self.node
    }
    /// Capture sizes held, ascending.
    pub fn sizes(&self) -> Vec<u32> {
        self.graphs.keys().copied().collect()
    }
}

impl<D: Device> Runner<D> {
    /// A runner on `device` with no nodes yet.
    pub fn new(device: D) -> Runner<D> {
        Runner {
            manager: WorkspaceManager::new(device),
            nodes: BTreeMap::new(),
            pending: Vec::new(),
        }
    }

    /// A runner for every fused node of `graph`, planned for world size `world`.
    ///
    /// # Errors
    /// As [`NodeKernels::from_graph`], for the first node that fails.
    pub fn for_graph(device: D, graph: &arfuse_ir::Graph, world: u32) -> Result<Runner<D>> {
        let mut r = Runner::new(device);
        for (_, n) in graph.nodes() {
            if matches!(n.op, arfuse_ir::Op::FusedAllreduceNorm(_)) {
                r.add(NodeKernels::from_graph(graph, &n.id, world)?)?;
            }
        }
        Ok(r)
    }

    /// Adds a node. The fallback chain starts at its plan's backend: mnnvl -> trtllm
    /// -> unfused, or trtllm -> unfused.
    ///
    /// # Errors
    /// [`Error::Invalid`] when a node with that id was added before.
    pub fn add(&mut self, kernels: NodeKernels) -> Result<()> {
        if self.nodes.contains_key(&kernels.node) {
            return Err(Error::Invalid(format!("node {} added twice", kernels.node)));
        }
        let chain = match kernels.backend {
            Backend::Mnnvl => vec![Some(Backend::Mnnvl), Some(Backend::Trtllm), None],
            Backend::Trtllm => vec![Some(Backend::Trtllm), None],
        };
        self.nodes.insert(
            kernels.node.clone(),
            NodeState {
                kernels,
                chain,
                prepared: None,
            },
        );
        Ok(())
    }

    /// The ids of the nodes, sorted.
    pub fn node_ids(&self) -> impl Iterator<Item = &str> + '_ {
        self.nodes.keys().map(String::as_str)
    }

    /// A node's launch description.
    pub fn kernels(&self, node: &str) -> Option<&NodeKernels> {
        self.nodes.get(node).map(|n| &n.kernels)
    }

    /// The device (for buffers, uploads and downloads).
    pub fn device(&mut self) -> &mut D {
        self.manager.factory_mut()
    }

    /// The workspace node `node` runs on, once prepared with a fused backend.
    pub fn workspace(&self, node: &str) -> Option<&D::Workspace> {
        let request = &self.nodes.get(node)?.kernels.workspace;
        self.manager.live(request)
    }

    /// How many distinct workspaces the prepared nodes use.
    pub fn workspaces(&self) -> usize {
        self.manager.live_count()
    }

    /// For every node: creates its workspace unless a node with the same request has
    /// one (first backend of the chain that works; failures are cached and never
    /// retried) and loads every kernel a token count of its plan can route to.
    /// Idempotent. Returns what each node settled on.
    ///
    /// # Errors
    /// [`Error::Capturing`] when called while the device captures; compiler and device
    /// errors while loading kernels (naming the node).
    pub fn prepare(&mut self) -> Result<Vec<(String, Prepared)>> {
        let ids: Vec<String> = self.nodes.keys().cloned().collect();
        let mut out = Vec::with_capacity(ids.len());
        let mut needed: Vec<Variant> = Vec::new();
        for id in ids {
            let p = self
                .prepare_node(&id, &mut needed)
                .map_err(|e| e.in_node(&id))?;
            out.push((id, p));
        }
        self.device().load(&needed)?;
        Ok(out)
    }

    fn prepare_node(&mut self, id: &str, needed: &mut Vec<Variant>) -> Result<Prepared> {
        let state = self
            .nodes
            .get(id)
            .ok_or_else(|| Error::Invalid(format!("no node {id}")))?;
        if let Some(p) = &state.prepared {
            return Ok(p.clone());
        }
        let k = state.kernels.clone();
        let chain = state.chain.clone();
        let prepared = match self.manager.acquire(k.workspace.clone(), &chain)? {
            Acquired::Fused { backend, .. } => Prepared::Fused(backend),
            Acquired::Unfused { reasons } => Prepared::Unfused(reasons),
        };
        for &(lo, _, _) in k.dispatch() {
            match k.route(lo)? {
                Route::Fused(v) => needed.push(v),
                Route::Unfused { local } => needed.push(local),
            }
        }
        // The unfused path serves every T when no workspace exists, and the T above
        // the fused range otherwise.
        needed.push(variants::virtual_allreduce(k.world, k.dtype));
        needed.push(k.local_variant());
        if let Some(s) = self.nodes.get_mut(id) {
            s.prepared = Some(prepared.clone());
        }
        Ok(prepared)
    }

    /// The node's description and settled workspace, or an error before `prepare`.
    fn prepared(&self, node: &str) -> Result<(NodeKernels, Prepared)> {
        let s = self
            .nodes
            .get(node)
            .ok_or_else(|| Error::Invalid(format!("no node {node} in this runner")))?;
        let p = s.prepared.clone().ok_or_else(|| {
            Error::Invalid(
                "prepare() must run before the first launch or capture (outside capture)".into(),
            )
        })?;
        Ok((s.kernels.clone(), p))
    }

    fn note_pending(&mut self, node: &str) {
        if !self.pending.iter().any(|n| n == node) {
            self.pending.push(node.to_string());
        }
    }

    /// Enqueues one call of node `node` with `tokens` tokens on the device (inside a
    /// capture it is recorded). Returns the route taken. A kernel that gives up
    /// waiting for a peer is reported by the next [`Runner::sync`].
    ///
    /// # Errors
    /// [`Error::Invalid`] for an unknown node, before [`Runner::prepare`], for a T
    /// outside the plan, for null inputs, or an unfused call whose norm and residual
    /// outputs both overlap an input or are dead; device errors. All name the node.
    pub fn launch(&mut self, node: &str, tokens: u32, t: &NodeTensors) -> Result<Route> {
        let r = self
            .launch_inner(node, tokens, t)
            .map_err(|e| e.in_node(node))?;
        self.note_pending(node);
        Ok(r)
    }

    fn launch_inner(&mut self, node: &str, tokens: u32, t: &NodeTensors) -> Result<Route> {
        let (k, prepared) = self.prepared(node)?;
        k.route(tokens)?;
        check_tensors(&k, t)?;
        let (dev, ws) = self.parts(&k, &prepared);
        launch_call(dev, ws, &k, tokens, t)
    }

    /// The device and, when the node runs fused, its workspace.
    fn parts(&mut self, k: &NodeKernels, prepared: &Prepared) -> (&mut D, Option<&D::Workspace>) {
        let (dev, ws) = self.manager.parts(&k.workspace);
        let ws = match prepared {
            Prepared::Fused(_) => ws.map(|(_, w)| w),
            Prepared::Unfused(_) => None,
        };
        (dev, ws)
    }

    /// Captures one graph per size in `sizes`, each holding one call of node `node`
    /// with tensors `t` (large enough for the largest size). Replay them with
    /// [`Runner::replay`].
    ///
    /// # Errors
    /// As [`Runner::launch`]; capture errors.
    pub fn capture(&mut self, node: &str, sizes: &[u32], t: &NodeTensors) -> Result<Captures<D>> {
        self.capture_inner(node, sizes, t)
            .map_err(|e| e.in_node(node))
    }

    fn capture_inner(&mut self, node: &str, sizes: &[u32], t: &NodeTensors) -> Result<Captures<D>> {
        let (k, prepared) = self.prepared(node)?;
        for &s in sizes {
            k.route(s)?;
        }
        check_tensors(&k, t)?;
        let (dev, ws) = self.parts(&k, &prepared);
        let mut graphs = BTreeMap::new();
        for &tokens in sizes {
            let g = dev.capture(&mut |d: &mut D| launch_call(d, ws, &k, tokens, t).map(|_| ()))?;
            graphs.insert(tokens, g);
        }
        Ok(Captures {
            node: node.to_string(),
            graphs,
        })
    }

    /// Enqueues the graph of capture size `tokens` from `captures` (one call of its
    /// node, with the tensors it was captured with).
    ///
    /// # Errors
    /// [`Error::Invalid`] when no graph of that size was captured; device errors. Both
    /// name the node.
    pub fn replay(&mut self, captures: &Captures<D>, tokens: u32) -> Result<()> {
        let node = captures.node.as_str();
        let g = captures.graphs.get(&tokens).ok_or_else(|| {
            Error::Invalid(format!("no graph captured for T = {tokens}")).in_node(node)
        })?;
        self.device().replay(g).map_err(|e| e.in_node(node))?;
        self.note_pending(node);
        Ok(())
    }

    /// Waits for every launch and replay enqueued so far, then reads (and clears) the
    /// error word of every workspace. A workspace whose kernel gave up waiting for a
    /// peer is reset ([`Device::reset_workspace`]: sentinels refilled, call state zero)
    /// before this returns, so the next call on it starts from a clean protocol state.
    ///
    /// # Errors
    /// [`Error::Node`] naming the node(s) launched since the last sync (comma-separated
    /// when several) around the device's error, or around [`Error::KernelTimeout`] for
    /// a kernel that gave up waiting for a peer (the nodes on that workspace).
    pub fn sync(&mut self) -> Result<()> {
        let pending = std::mem::take(&mut self.pending);
        let names = |filter: &dyn Fn(&str) -> bool| -> String {
            let n: Vec<&str> = pending
                .iter()
                .map(String::as_str)
                .filter(|n| filter(n))
                .collect();
            if n.is_empty() {
                "(none launched since the last sync)".to_string()
            } else {
                n.join(", ")
            }
        };
        let nodes = &self.nodes;
        let (dev, live) = self.manager.all_parts();
        if let Err(e) = dev.sync() {
            return Err(e.in_node(&names(&|_| true)));
        }
        let mut first = None;
        for (request, ws) in live {
            if let Err(e) = dev.take_error(ws) {
                let on_ws = |n: &str| {
                    nodes
                        .get(n)
                        .is_some_and(|s| &s.kernels.workspace == request)
                };
                // A timed-out call leaves the ranks disagreeing on the call count and
                // partial data in a buffer: reset before the workspace is used again.
                let e = match e {
                    Error::KernelTimeout(_) => match dev.reset_workspace(ws) {
                        Ok(()) => e,
                        Err(r) => Error::Invalid(format!(
                            "{e}; resetting the workspace afterwards failed: {r}"
                        )),
                    },
                    e => e,
                };
                first.get_or_insert(e.in_node(&names(&on_ws)));
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// One call of node `k`: fused when its route is fused and a workspace exists, else
/// the unfused path. Returns the route taken.
fn launch_call<D: Device>(
    dev: &mut D,
    ws: Option<&D::Workspace>,
    k: &NodeKernels,
    tokens: u32,
    t: &NodeTensors,
) -> Result<Route> {
    match (k.route(tokens)?, ws) {
        (Route::Fused(v), Some(ws)) => {
            dev.launch_fused(ws, &node_call(k, v, tokens, base_params(k, t)))?;
            Ok(Route::Fused(v))
        }
        _ => {
            launch_unfused_node(dev, k, tokens, t)?;
            Ok(Route::Unfused {
                local: k.local_variant(),
            })
        }
    }
}

/// The inputs every call reads must be present (a null pointer would fault the kernel
/// and lose the CUDA context).
fn check_tensors(k: &NodeKernels, t: &NodeTensors) -> Result<()> {
    let needs_scale = k.epilogue.quant.takes_scale_input();
    for (missing, what) in [
        (t.x.ptr == 0, "x"),
        (k.epilogue.residual && t.residual_in.ptr == 0, "residual_in"),
        (t.gamma == 0, "gamma"),
        (needs_scale && t.scale_in == 0, "scale_in"),
    ] {
        if missing {
            return Err(Error::Invalid(format!("tensor {what} is null")));
        }
    }
    Ok(())
}

fn base_params(k: &NodeKernels, t: &NodeTensors) -> KernelParams {
    KernelParams {
        x: t.x,
        residual_in: if k.epilogue.residual {
            t.residual_in
        } else {
            RankTensor::default()
        },
        residual_out: t.residual_out,
        out: t.out,
        quant_out: t.quant_out,
        scale_out: t.scale_out,
        gamma: t.gamma,
        scale_in: t.scale_in,
        eps: k.eps,
        weight_bias: k.weight_bias,
        gamma_f32: i32::from(k.gamma_f32),
        norm_round_twice: i32::from(k.norm_round_twice),
        norm_f32_sum: i32::from(k.norm_f32_sum),
        timeout_ns: device::DEFAULT_TIMEOUT_NS,
        ..KernelParams::default()
    }
}

/// A call of node `k` with `variant` at `tokens` tokens.
fn node_call(k: &NodeKernels, variant: Variant, tokens: u32, params: KernelParams) -> FusedCall {
    FusedCall {
        variant,
        tokens,
        hidden: k.hidden,
        ranks: k.world,
        params,
    }
}

/// Byte range `[start, end)` the W ranks' `[T, H]` slices of `t` cover.
fn extent(t: RankTensor, k: &NodeKernels, tokens: u32) -> Option<(u64, u64)> {
    if t.ptr == 0 {
        return None;
    }
    let row = u64::from(tokens) * u64::from(k.hidden) * k.dtype.element_bytes();
    let last = t.rank_stride.saturating_mul(u64::from(k.world) - 1);
    Some((t.ptr, t.ptr.saturating_add(last).saturating_add(row)))
}

fn overlaps(a: Option<(u64, u64)>, b: Option<(u64, u64)>) -> bool {
    matches!((a, b), (Some(a), Some(b)) if a.0 < b.1 && b.0 < a.1)
}

/// Unfused: the virtual-rank all-reduce writes the reduced tensor into the norm output
/// (or the residual output), then the local kernel reads it from there and overwrites
/// it in place (each thread loads its vectors of a token before any of them is
/// written). The staging output must not overlap `x` (other ranks still read it while
/// the all-reduce writes) nor `residual_in` (the local kernel reads it after).
fn launch_unfused_node<D: Device>(
    dev: &mut D,
    k: &NodeKernels,
    tokens: u32,
    t: &NodeTensors,
) -> Result<()> {
    let inputs = [extent(t.x, k, tokens), extent(t.residual_in, k, tokens)];
    let stage = [t.out, t.residual_out]
        .into_iter()
        .find(|c| {
            let e = extent(*c, k, tokens);
            e.is_some() && !inputs.iter().any(|i| overlaps(e, *i))
        })
        .ok_or_else(|| {
            Error::Invalid(format!(
                "node {}: the unfused path stages the all-reduce in the norm or residual output, and neither is live without overlapping x or residual_in; pass a separate output buffer",
                k.node
            ))
        })?;
    let mut ar = base_params(k, t);
    ar.out = stage;
    let allreduce = variants::virtual_allreduce(k.world, k.dtype);
    dev.launch_virtual_allreduce(&node_call(k, allreduce, tokens, ar))?;
    let mut local = base_params(k, t);
    local.x = stage;
    dev.launch_local(&node_call(k, k.local_variant(), tokens, local))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arfuse_ir::{
        DType, DispatchRange, FusedAllReduceNorm, FusedOutput, FusedPlan, FusedQuant,
        Strategy as IrStrategy,
    };

    fn kernels() -> NodeKernels {
        let attrs = FusedAllReduceNorm {
            group: "tp".into(),
            eps: 1e-6,
            weight_bias: 0.0,
            norm_rounding: arfuse_ir::NormRounding::Once,
            norm_input: arfuse_ir::NormInput::Residual,
            residual: true,
            quant: FusedQuant::None,
            outputs: vec![FusedOutput::Norm, FusedOutput::Residual],
            plan: Some(FusedPlan {
                pattern_code: 1,
                max_token_num: 16,
                workspace: arfuse_policy::Workspace::arfuse(
                    arfuse_policy::Backend::Trtllm,
                    4,
                    256,
                    arfuse_policy::ActDtype::Bf16,
                    Some(16),
                    1 << 18,
                )
                .unwrap(),
                dispatch: vec![DispatchRange {
                    min_tokens: 1,
                    max_tokens: 64,
                    strategy: IrStrategy::Unfused,
                    required_bytes: 0,
                }],
            }),
        };
        NodeKernels::new("n", &attrs, DType::Bf16, 256, DType::Bf16, 4).unwrap()
    }

    #[test]
    fn staging_never_overlaps_an_input() {
        let k = kernels();
        // 4 ranks x 2 tokens x 256 bf16 = 1 KiB per rank.
        let t = |ptr| RankTensor {
            ptr,
            rank_stride: 1024,
        };
        assert_eq!(
            extent(t(0x1000), &k, 2),
            Some((0x1000, 0x1000 + 3 * 1024 + 1024))
        );
        assert_eq!(extent(RankTensor::default(), &k, 2), None);
        let x = extent(t(0x1000), &k, 2);
        assert!(overlaps(x, extent(t(0x1000 + 4095), &k, 2)));
        assert!(!overlaps(x, extent(t(0x1000 + 4096), &k, 2)));
        assert!(!overlaps(x, None));
    }

    #[test]
    fn null_inputs_are_errors_naming_the_tensor_and_the_node() {
        let k = kernels();
        let mut t = NodeTensors {
            x: RankTensor {
                ptr: 0x1000,
                rank_stride: 1024,
            },
            residual_in: RankTensor {
                ptr: 0x9000,
                rank_stride: 1024,
            },
            gamma: 0x20000,
            ..NodeTensors::default()
        };
        check_tensors(&k, &t).unwrap();
        t.residual_in = RankTensor::default();
        let e = check_tensors(&k, &t).unwrap_err().in_node("n");
        assert_eq!(
            e.to_string(),
            "node n: invalid argument: tensor residual_in is null"
        );
        // A message that already names the node is not wrapped twice.
        let routed = k.route(65).unwrap_err().in_node("n");
        let text = routed.to_string();
        assert!(
            text.contains("node n: T = 65") && text.matches("node n").count() == 1,
            "{text}"
        );
    }
}
