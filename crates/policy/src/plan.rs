//! The plan: backend, workspace and a per-T dispatch, proven for every token count the
//! graph can run with (domain.md §3-§5).

use std::collections::BTreeMap;
use std::fmt;
use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};

use crate::backend::{resolve_backend, Backend, BackendDecision};
use crate::bytes;
use crate::error::{PolicyError, Result};
use crate::limits;
use crate::strategy::{self, Strategy, PDL_ADVANCE_LAUNCH_TOKENS};
use crate::target::{ActDtype, KernelLibrary, Target, UnfusedAllReduce};
use crate::verify::{verify_inner, Violation};
use crate::workspace::{Misfit, Workspace};

/// Consecutive token counts that share one strategy and one reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchRange {
    /// First token count of the range (tokens, >= 1).
    pub lo: u64,
    /// Last token count of the range (tokens, inclusive).
    pub hi: u64,
    /// How calls with T in `lo..=hi` run.
    pub strategy: Strategy,
    /// Bytes of one buffer the largest call of the range needs (at T = `hi`); 0 when
    /// unfused. Required bytes grow with T, so this bounds the whole range.
    pub required_bytes_max: u64,
    /// Bytes of the buffer the strategy uses (one Lamport buffer, or trtllm's comm
    /// buffer for two-shot); 0 when unfused.
    pub available_bytes: u64,
    /// Why this strategy for these T.
    pub reason: String,
}

impl DispatchRange {
    /// The token counts covered, `lo..=hi`.
    pub fn tokens(&self) -> RangeInclusive<u64> {
        self.lo..=self.hi
    }

    /// Whether `t` lies in the range.
    pub fn contains(&self, t: u64) -> bool {
        self.lo <= t && t <= self.hi
    }
}

impl fmt::Display for DispatchRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.lo == self.hi {
            write!(f, "T={}", self.lo)?;
        } else {
            write!(f, "T={}..={}", self.lo, self.hi)?;
        }
        write!(f, " {}", self.strategy)?;
        if self.strategy.is_fused() {
            write!(
                f,
                " (needs <= {} of {} bytes)",
                self.required_bytes_max, self.available_bytes
            )?;
        }
        write!(f, ": {}", self.reason)
    }
}

/// The dispatch of one hidden size sharing the workspace (a fused site's H).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiteDispatch {
    /// Hidden size in elements.
    pub hidden: u64,
    /// Ranges covering `1..=max_planned_tokens`, ascending, without gaps or overlaps.
    pub ranges: Vec<DispatchRange>,
}

/// Where an extra token count to check comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum PointSource {
    /// A CUDA-graph capture size.
    CaptureSize,
    /// A compile-range boundary.
    CompileRangeBoundary,
    /// `capture_size * (1 + num_speculative_tokens)`.
    SpeculativeDecode {
        /// The capture size (requests) it was derived from.
        capture_size: u64,
    },
}

impl fmt::Display for PointSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PointSource::CaptureSize => f.write_str("capture size"),
            PointSource::CompileRangeBoundary => f.write_str("compile-range boundary"),
            PointSource::SpeculativeDecode { capture_size } => write!(
                f,
                "speculative-decoding multiple of capture size {capture_size}"
            ),
        }
    }
}

/// One extra token count the graph can run with, and what the plan does there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenPoint {
    /// Token count.
    pub t: u64,
    /// Where it comes from.
    pub source: PointSource,
    /// Strategy at the widest hidden size.
    pub strategy: Strategy,
    /// True when `t` exceeds the engine's max batched tokens (reported in the notes).
    pub beyond_max_batched_tokens: bool,
}

/// A complete, verified fusion plan for one workspace (one group, backend and dtype).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Fuse with a backend, or not; with the reason.
    pub decision: BackendDecision,
    /// The kernels the plan is for (their layout, capacity and strategy rule).
    pub kernels: KernelLibrary,
    /// Compute capability the plan was made for.
    pub sm: u32,
    /// W, ranks in the group.
    pub world_size: u32,
    /// Activation dtype.
    pub dtype: ActDtype,
    /// Deterministic mode: one reduction order for every T.
    pub deterministic: bool,
    /// Which all-reduce serves the unfused T.
    pub unfused_all_reduce: UnfusedAllReduce,
    /// Every path of the plan (each fused strategy and the unfused one) reduces in one
    /// order, so a token's outputs do not depend on the batch it is in: arfuse's kernels
    /// with arfuse-runtime's unfused path, or one fused strategy for every T.
    pub batch_invariant: bool,
    /// The engine's max batched tokens (tokens).
    pub max_batched_tokens: u64,
    /// Largest T planned (tokens): max batched tokens or the largest extra point.
    pub max_planned_tokens: u64,
    /// Size cap used (bytes of per-rank input): the table entry or the override.
    pub max_bytes: Option<u64>,
    /// Largest fused T (tokens): `min(floor(max_bytes / (H*e)), max_batched_tokens)` at
    /// the workspace's H; 0 when not fusing.
    pub max_token_num: u64,
    /// The workspace the dispatch was checked against; `None` when not fusing.
    pub workspace: Option<Workspace>,
    /// For a plan of arfuse's kernels: what FlashInfer's default sizing would allocate
    /// for the same target, backend, hidden size and M ([`Workspace::flashinfer`]), for
    /// comparison; `None` otherwise.
    pub flashinfer_workspace: Option<Workspace>,
    /// One dispatch per distinct hidden size, widest first (the workspace's H).
    pub sites: Vec<SiteDispatch>,
    /// Capture sizes, compile-range boundaries and speculative multiples, each checked.
    pub points: Vec<TokenPoint>,
    /// Every decision taken, as sentences, in order.
    pub notes: Vec<String>,
}

/// Why a range got its strategy (internal; rendered into `DispatchRange::reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    AboveMaxTokenNum,
    Preferred(Strategy),
    Fallback {
        preferred: Strategy,
        fail: Fail,
    },
    NothingFits {
        preferred: Strategy,
        fail: Fail,
        other_fail: Fail,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fail {
    BelowWorldSize,
    DoesNotFit,
}

impl From<Misfit> for Fail {
    fn from(m: Misfit) -> Fail {
        match m {
            Misfit::BelowWorldSize { .. } => Fail::BelowWorldSize,
            Misfit::TooLarge { .. } => Fail::DoesNotFit,
        }
    }
}

/// Everything the per-T rule needs, borrowed from a plan.
struct Ctx<'a> {
    kernels: KernelLibrary,
    backend: Backend,
    sm: u32,
    w: u32,
    dtype: ActDtype,
    m: u64,
    t_max: u64,
    max_bytes: u64,
    ws: &'a Workspace,
}

fn other(s: Strategy) -> Strategy {
    match s {
        Strategy::OneShot => Strategy::TwoShot,
        _ => Strategy::OneShot,
    }
}

impl Ctx<'_> {
    fn fail(&self, s: Strategy, t: u64, h: u64) -> Result<Option<Fail>> {
        Ok(self.ws.misfit(s, t, h)?.map(Fail::from))
    }

    /// The rule for one T: the preferred strategy if it fits, else the other fused one
    /// if it fits, else unfused.
    fn decide(&self, t: u64, h: u64) -> Result<(Strategy, Why)> {
        if t > self.m {
            return Ok((Strategy::Unfused, Why::AboveMaxTokenNum));
        }
        let preferred = strategy::preferred_strategy(
            self.kernels,
            self.backend,
            self.sm,
            self.w,
            h,
            self.dtype,
            t,
        )?;
        let Some(fail) = self.fail(preferred, t, h)? else {
            return Ok((preferred, Why::Preferred(preferred)));
        };
        let alt = other(preferred);
        match self.fail(alt, t, h)? {
            None => Ok((alt, Why::Fallback { preferred, fail })),
            Some(other_fail) => Ok((
                Strategy::Unfused,
                Why::NothingFits {
                    preferred,
                    fail,
                    other_fail,
                },
            )),
        }
    }

    fn rule_name(&self, h: u64) -> String {
        match (self.kernels, self.backend) {
            (KernelLibrary::Arfuse, _) => "arfuse's Lamport rule (one-shot iff T*H*W*e <= 1 MiB, \
                                           FlashInfer's mnnvl AUTO threshold)"
                .to_string(),
            (KernelLibrary::Flashinfer, Backend::Mnnvl) => {
                "FlashInfer's mnnvl AUTO rule (one-shot iff T*H*W*e <= 1 MiB)".to_string()
            }
            (KernelLibrary::Flashinfer, Backend::Trtllm) => {
                match limits::trtllm_one_shot_bound(self.sm, self.w) {
                    Some(b) => format!(
                        "vLLM's trtllm one-shot table (one-shot iff T*H*e <= {b} bytes, \
                     SM {} W={}; H={h})",
                        self.sm, self.w
                    ),
                    None => format!(
                        "vLLM's trtllm selector (no table entry for SM {} W={}: one-shot)",
                        self.sm, self.w
                    ),
                }
            }
        }
    }

    fn buffer_name(&self, s: Strategy) -> String {
        let what = match (self.kernels, self.backend, s) {
            (KernelLibrary::Flashinfer, Backend::Trtllm, Strategy::TwoShot) => {
                "the trtllm comm buffer"
            }
            _ => "one Lamport buffer",
        };
        format!("{what} of {} bytes", self.ws.available_bytes(s))
    }

    fn fail_text(&self, s: Strategy, fail: Fail) -> String {
        match fail {
            Fail::BelowWorldSize => {
                format!("FlashInfer's two-shot needs T >= W = {}", self.w)
            }
            Fail::DoesNotFit => {
                let formula = match (self.kernels, self.backend, s) {
                    (KernelLibrary::Flashinfer, Backend::Trtllm, Strategy::TwoShot) => "W*T*H*e",
                    (_, _, Strategy::TwoShot) => "2*ceil(T/W)*W*H*e",
                    _ => "T*H*W*e",
                };
                format!(
                    "{s} needs {formula} bytes, more than {}",
                    self.buffer_name(s)
                )
            }
        }
    }

    fn render(&self, why: Why, h: u64) -> String {
        match why {
            Why::AboveMaxTokenNum => format!(
                "T > max_token_num {} = min(floor({} bytes / (H*e)), max batched tokens) at \
                 the workspace's H",
                self.m, self.max_bytes
            ),
            Why::Preferred(s) => format!(
                "{} picks {s}, and it fits {}",
                self.rule_name(h),
                self.buffer_name(s)
            ),
            Why::Fallback { preferred, fail } => {
                let alt = other(preferred);
                format!(
                    "{} picks {preferred}, but {}; {alt} fits {}",
                    self.rule_name(h),
                    self.fail_text(preferred, fail),
                    self.buffer_name(alt)
                )
            }
            Why::NothingFits {
                preferred,
                fail,
                other_fail,
            } => format!(
                "{} picks {preferred}, but {}, and {}",
                self.rule_name(h),
                self.fail_text(preferred, fail),
                self.fail_text(other(preferred), other_fail)
            ),
        }
    }

    fn range(
        &self,
        lo: u64,
        hi: u64,
        s: Strategy,
        reason: String,
        h: u64,
    ) -> Result<DispatchRange> {
        dispatch_range(Some(self.ws), lo, hi, s, reason, h)
    }

    /// The dispatch at hidden `h` for `1..=t_max`, computed on segments between the
    /// rule's breakpoints (every comparison the rule makes is monotone in T), with both
    /// ends of every segment evaluated as a check.
    fn site_ranges(&self, h: u64) -> Result<Vec<DispatchRange>> {
        let a0 = strategy::preferred_one_shot_max(
            self.kernels,
            self.backend,
            self.sm,
            self.w,
            h,
            self.dtype,
        )?;
        let f1 = self.ws.capacity_tokens(Strategy::OneShot, h)?;
        let f2 = self.ws.capacity_tokens(Strategy::TwoShot, h)?;
        let mut starts: Vec<u64> = [
            1,
            a0.saturating_add(1),
            f1.saturating_add(1),
            f2.saturating_add(1),
            u64::from(self.w),
            self.m.saturating_add(1),
        ]
        .into_iter()
        .filter(|&s| s >= 1 && s <= self.t_max)
        .collect();
        starts.sort_unstable();
        starts.dedup();
        // (lo, hi, strategy, [(lo, hi, why)]): consecutive T with one strategy form one
        // range; its reason lists each sub-range's own reason.
        type Segment = (u64, u64, Strategy, Vec<(u64, u64, Why)>);
        let mut segments: Vec<Segment> = Vec::new();
        for (i, &lo) in starts.iter().enumerate() {
            let hi = starts.get(i + 1).map_or(self.t_max, |next| next - 1);
            let (s, why) = self.decide(lo, h)?;
            if self.decide(hi, h)? != (s, why) {
                return Err(PolicyError::Internal {
                    details: format!("the rule is not constant on T={lo}..={hi} at H={h}"),
                });
            }
            match segments.last_mut() {
                Some(last) if last.2 == s => {
                    last.1 = hi;
                    match last.3.last_mut() {
                        Some(part) if part.2 == why => part.1 = hi,
                        _ => last.3.push((lo, hi, why)),
                    }
                }
                _ => segments.push((lo, hi, s, vec![(lo, hi, why)])),
            }
        }
        segments
            .into_iter()
            .map(|(lo, hi, s, parts)| {
                let reason = if let [(_, _, why)] = parts.as_slice() {
                    self.render(*why, h)
                } else {
                    parts
                        .iter()
                        .map(|&(a, b, why)| {
                            let span = if a == b {
                                format!("T={a}")
                            } else {
                                format!("T={a}..={b}")
                            };
                            format!("{span}: {}", self.render(why, h))
                        })
                        .collect::<Vec<_>>()
                        .join("; ")
                };
                self.range(lo, hi, s, reason, h)
            })
            .collect()
    }
}

/// Plans the fusion for `target`, with its own workspace sized for the widest of
/// `hidden_sizes` (elements; every graph that shares the workspace, e.g. a target
/// model and its speculative draft).
///
/// The dispatch covers every T in `1..=max(max_batched_tokens, capture sizes,
/// compile-range boundaries, speculative multiples)` and is verified before it is
/// returned.
///
/// Errors: [`PolicyError::InvalidField`] (target), [`PolicyError::InvalidHidden`]
/// (empty list, H = 0, a row above the kernels' maximum), backend errors of
/// [`resolve_backend`], [`PolicyError::Overflow`].
pub fn plan(target: &Target, hidden_sizes: &[u64]) -> Result<Plan> {
    build(target, hidden_sizes, None)
}

/// Like [`plan`], but against a workspace given from outside (for example one an
/// engine already allocated): the dispatch only uses what that workspace holds.
///
/// Errors: as [`plan`], and [`PolicyError::WorkspaceMismatch`] when the workspace's
/// backend, dtype or W differ from the target's resolved ones, when it was sized for a
/// narrower hidden size than the widest given (the draft-wider-than-target bug), or
/// when it has problems of its own ([`Workspace::problems`]).
pub fn plan_with_workspace(
    target: &Target,
    hidden_sizes: &[u64],
    workspace: &Workspace,
) -> Result<Plan> {
    build(target, hidden_sizes, Some(workspace))
}

fn collect_points(target: &Target) -> Result<Vec<(u64, PointSource)>> {
    let mut points: Vec<(u64, PointSource)> = Vec::new();
    points.extend(
        target
            .capture_sizes
            .iter()
            .map(|&c| (c, PointSource::CaptureSize)),
    );
    points.extend(
        target
            .compile_range_boundaries
            .iter()
            .map(|&b| (b, PointSource::CompileRangeBoundary)),
    );
    if target.num_speculative_tokens > 0 {
        let per_request = bytes::add(target.num_speculative_tokens, 1, "speculative tokens")?;
        for &c in &target.capture_sizes {
            let t = bytes::mul(c, per_request, "speculative multiple")?;
            points.push((t, PointSource::SpeculativeDecode { capture_size: c }));
        }
    }
    Ok(points)
}

fn build(target: &Target, hidden_sizes: &[u64], given: Option<&Workspace>) -> Result<Plan> {
    target.validate()?;
    if hidden_sizes.is_empty() {
        return Err(PolicyError::InvalidHidden {
            hidden: 0,
            reason: "no hidden sizes given; pass the hidden size of every graph sharing \
                     the workspace"
                .to_string(),
        });
    }
    for &h in hidden_sizes {
        limits::check_hidden(h, target.dtype)?;
    }
    let mut hiddens: Vec<u64> = hidden_sizes.to_vec();
    hiddens.sort_unstable_by(|a, b| b.cmp(a));
    hiddens.dedup();

    let raw_points = collect_points(target)?;
    let t_max = raw_points
        .iter()
        .map(|p| p.0)
        .fold(target.max_batched_tokens, u64::max);

    let mut plan = Plan {
        decision: resolve_backend(target)?,
        kernels: target.kernels,
        sm: target.sm,
        world_size: target.world_size,
        dtype: target.dtype,
        deterministic: target.deterministic,
        unfused_all_reduce: target.unfused_all_reduce,
        batch_invariant: false,
        max_batched_tokens: target.max_batched_tokens,
        max_planned_tokens: t_max,
        max_bytes: None,
        max_token_num: 0,
        workspace: None,
        flashinfer_workspace: None,
        sites: Vec::new(),
        points: Vec::new(),
        notes: Vec::new(),
    };
    plan.notes.push(plan.decision.to_string());
    if let Some(backend) = plan.decision.backend() {
        plan_fused(&mut plan, target, backend, &hiddens, given)?;
    } else if given.is_some() {
        plan.notes
            .push("the workspace given is not used: no fusion".to_string());
    }
    if plan.sites.is_empty() {
        plan.sites = hiddens
            .iter()
            .map(|&h| SiteDispatch {
                hidden: h,
                ranges: vec![unfused_all(t_max, plan.decision.reason())],
            })
            .collect();
    }
    finish(&mut plan, raw_points)?;
    note_batch_invariance(&mut plan);
    let violations = verify_inner(&plan, plan.workspace.as_ref());
    if !violations.is_empty() {
        return Err(PolicyError::Internal {
            details: violations
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        });
    }
    Ok(plan)
}

fn unfused_all(t_max: u64, reason: &str) -> DispatchRange {
    DispatchRange {
        lo: 1,
        hi: t_max,
        strategy: Strategy::Unfused,
        required_bytes_max: 0,
        available_bytes: 0,
        reason: format!("no fusion: {reason}"),
    }
}

/// Turns the plan into "no fusion" with `reason` (sites are filled by the caller).
fn refuse(plan: &mut Plan, reason: String) {
    plan.notes.push(format!("no fusion: {reason}"));
    plan.decision = BackendDecision::NoFusion { reason };
    plan.workspace = None;
    plan.flashinfer_workspace = None;
    plan.max_token_num = 0;
    plan.sites.clear();
}

/// The fused part of planning, as its steps: the hidden sizes the kernels run, the
/// size cap and max_token_num M ([`token_cap`]), the workspace
/// ([`choose_workspace`]), the dispatch of every site ([`dispatch_sites`]), then the
/// plan takes them ([`take_fused`]). A step that refuses the plan returns `None`
/// after [`refuse`].
fn plan_fused(
    plan: &mut Plan,
    target: &Target,
    backend: Backend,
    hiddens: &[u64],
    given: Option<&Workspace>,
) -> Result<()> {
    // arfuse's kernels are built for the ABI's world sizes only, whatever the backend
    // and the size table allow (a max_bytes_override fused W = 6 and W = 32 once).
    if target.kernels == KernelLibrary::Arfuse {
        if let Some(why) = arfuse_abi::world_unsupported(target.world_size) {
            refuse(plan, why);
            return Ok(());
        }
    }
    let unsupported = unsupported_hiddens(target, hiddens)?;
    let Some((h_ws, max_bytes, m)) = token_cap(plan, target, hiddens, &unsupported)? else {
        return Ok(());
    };
    let shape = Shape {
        target,
        backend,
        hiddens,
        unsupported: &unsupported,
        h_ws,
        m,
        max_bytes,
        t_max: plan.max_planned_tokens,
    };
    let Some(ws) = choose_workspace(plan, &shape, given)? else {
        return Ok(());
    };
    let Some(sites) = dispatch_sites(plan, &shape, &ws)? else {
        return Ok(());
    };
    take_fused(plan, &shape, ws, sites)
}

/// The workspace's hidden size (the widest the kernels run), the size cap in bytes
/// and max_token_num M, with the size-cap note; `None` when the plan was refused (no
/// hidden size runs, no size-table entry, or no token row fits the cap).
fn token_cap(
    plan: &mut Plan,
    target: &Target,
    hiddens: &[u64],
    unsupported: &BTreeMap<u64, String>,
) -> Result<Option<(u64, u64, u64)>> {
    let Some(&h_ws) = hiddens.iter().find(|h| !unsupported.contains_key(h)) else {
        let why = unsupported.values().next().cloned().unwrap_or_default();
        refuse(plan, why);
        return Ok(None);
    };
    let Some((max_bytes, source)) = size_cap(plan, target) else {
        return Ok(None);
    };
    let dtype = target.dtype;
    let m = limits::max_token_num(max_bytes, h_ws, dtype, target.max_batched_tokens)?;
    plan.notes.push(format!(
        "size cap {max_bytes} bytes of all-reduce input (cap per rank) from {source}; \
         max_token_num = min(floor({max_bytes} / ({h_ws}*{})), {}) = {m} at the widest \
         hidden size H={h_ws}",
        dtype.element_bytes(),
        target.max_batched_tokens
    ));
    if m == 0 {
        refuse(
            plan,
            format!(
                "one token row of H={h_ws} ({dtype}) is larger than the size cap of \
                 {max_bytes} bytes, so no T is eligible"
            ),
        );
        return Ok(None);
    }
    Ok(Some((h_ws, max_bytes, m)))
}

/// The workspace: the one given (checked against the target), else the one sized for
/// the plan; with its note (and FlashInfer trtllm's clamp note). `None` when the plan
/// was refused (no T fits any fused strategy).
fn choose_workspace(
    plan: &mut Plan,
    shape: &Shape<'_>,
    given: Option<&Workspace>,
) -> Result<Option<Workspace>> {
    let target = shape.target;
    let ws = match given {
        Some(ws) => {
            check_given(
                ws,
                target.kernels,
                shape.backend,
                target.world_size,
                target.dtype,
                shape.h_ws,
            )?;
            ws.clone()
        }
        None => match shape.size_workspace()? {
            Some(ws) => ws,
            None => {
                refuse(
                    plan,
                    format!(
                        "no T in 1..={} fits any fused strategy of {}",
                        shape.m, target.kernels
                    ),
                );
                return Ok(None);
            }
        },
    };
    plan.notes.push(ws.to_string());
    if ws.kernels == KernelLibrary::Flashinfer
        && shape.backend == Backend::Trtllm
        && ws.comm_buffer_bytes > ws.lamport_buffer_bytes
    {
        plan.notes.push(format!(
            "the trtllm Lamport comm size W*M*H*e ({} bytes) exceeds {} bytes; one Lamport \
             buffer is clamped there and one-shot is refused above it",
            ws.comm_buffer_bytes,
            limits::LAMPORT_MAX_COMM_BYTES
        ));
    }
    Ok(Some(ws))
}

/// Every site's dispatch against `ws`; `None` when the plan was refused (a
/// deterministic-mode refusal, or no T of any site fuses).
fn dispatch_sites(
    plan: &mut Plan,
    shape: &Shape<'_>,
    ws: &Workspace,
) -> Result<Option<Vec<SiteDispatch>>> {
    let sites = match shape.sites(ws) {
        Ok(sites) => sites,
        Err(PlanStep::Refused(Refusal(why))) => {
            refuse(plan, why);
            return Ok(None);
        }
        Err(PlanStep::Error(e)) => return Err(e),
    };
    if !sites
        .iter()
        .any(|s| s.ranges.iter().any(|r| r.strategy.is_fused()))
    {
        refuse(
            plan,
            format!(
                "no T in 1..={} fits the workspace with any fused strategy ({ws})",
                shape.m
            ),
        );
        return Ok(None);
    }
    if let Some(why) = engine_order_in_deterministic_mode(shape.target, &sites, shape.m) {
        refuse(plan, why);
        return Ok(None);
    }
    Ok(Some(sites))
}

/// The plan takes the fused result: M, the size cap, the workspace (and for arfuse's
/// kernels FlashInfer's sizing of the same M for comparison), the sites, the PDL note.
fn take_fused(
    plan: &mut Plan,
    shape: &Shape<'_>,
    ws: Workspace,
    sites: Vec<SiteDispatch>,
) -> Result<()> {
    let target = shape.target;
    if ws.kernels == KernelLibrary::Arfuse {
        plan.flashinfer_workspace = Some(Workspace::flashinfer(
            shape.backend,
            target.world_size,
            shape.h_ws,
            target.dtype,
            shape.m,
        )?);
    }
    plan.max_bytes = Some(shape.max_bytes);
    plan.max_token_num = shape.m;
    plan.workspace = Some(ws);
    plan.sites = sites;
    plan.notes.push(format!(
        "PDL: one-shot kernels and calls with T > {PDL_ADVANCE_LAUNCH_TOKENS} trigger \
         completion at their end; two-shot calls with T <= {PDL_ADVANCE_LAUNCH_TOKENS} may \
         trigger early"
    ));
    Ok(())
}

/// Deterministic mode with arfuse's kernels: every fused strategy reduces in the
/// contract's order, but a T the plan leaves unfused runs through the engine's
/// all-reduce when `unfused_all_reduce = "engine"`, in another order: the reason to
/// refuse, naming the range and the fixes.
fn engine_order_in_deterministic_mode(
    target: &Target,
    sites: &[SiteDispatch],
    m: u64,
) -> Option<String> {
    if !target.deterministic
        || target.kernels != KernelLibrary::Arfuse
        || target.unfused_all_reduce != UnfusedAllReduce::Engine
    {
        return None;
    }
    let (h, r) = sites.iter().find_map(|s| {
        s.ranges
            .iter()
            .find(|r| !r.strategy.is_fused())
            .map(|r| (s.hidden, r))
    })?;
    Some(format!(
        "deterministic mode needs one reduction order for every T, and \
         T={}..={} (H={h}) would run unfused through the engine's all-reduce, whose order \
         differs from arfuse's kernels'; bound max_batched_tokens and the capture sizes to \
         max_token_num {m}, or serve them with arfuse-runtime's unfused path \
         (unfused_all_reduce = \"arfuse\")",
        r.lo, r.hi
    ))
}

/// Whether the strategies `used` (over every site and T of a plan) reduce in one
/// order, for `kernels` with unfused T served by `unfused`: arfuse's one-shot and
/// two-shot and arfuse-runtime's unfused path all follow the contract's order (rank
/// order from +0.0, the RMSNorm sum in the kernels' block tree for H); FlashInfer's
/// strategies each have their own, and the engine's all-reduce another.
pub(crate) fn one_reduction_order(
    kernels: KernelLibrary,
    unfused: UnfusedAllReduce,
    used: &std::collections::BTreeSet<Strategy>,
) -> bool {
    let has_unfused = used.contains(&Strategy::Unfused);
    match kernels {
        KernelLibrary::Arfuse => !has_unfused || unfused == UnfusedAllReduce::Arfuse,
        KernelLibrary::Flashinfer => used.len() <= 1 && !has_unfused,
    }
}

/// Sets [`Plan::batch_invariant`] and says why in the notes.
fn note_batch_invariance(plan: &mut Plan) {
    if plan.backend().is_none() {
        return;
    }
    let used: std::collections::BTreeSet<Strategy> = plan
        .sites
        .iter()
        .flat_map(|s| s.ranges.iter().map(|r| r.strategy))
        .collect();
    plan.batch_invariant = one_reduction_order(plan.kernels, plan.unfused_all_reduce, &used);
    let note = match (plan.batch_invariant, plan.kernels) {
        (true, KernelLibrary::Arfuse) => "batch-invariant: one reduction order on all paths \
             (arfuse's one-shot, two-shot and unfused path: the all-reduce in rank order from \
             +0.0, the RMSNorm sum in the kernels' block tree for H), so a token's outputs \
             do not depend on the batch it is in"
            .to_string(),
        (true, KernelLibrary::Flashinfer) => {
            "batch-invariant: one fused strategy for every T".to_string()
        }
        (false, KernelLibrary::Arfuse) => "not batch-invariant: the unfused T run through \
             the engine's all-reduce (unfused_all_reduce = \"engine\"), whose reduction \
             order differs from arfuse's kernels'"
            .to_string(),
        (false, KernelLibrary::Flashinfer) => "not batch-invariant: FlashInfer's one-shot, \
             two-shot and unfused paths reduce in different orders"
            .to_string(),
    };
    plan.notes.push(note);
}

/// Hidden sizes the target's kernels cannot run, with the reason; those sites stay
/// unfused.
fn unsupported_hiddens(target: &Target, hiddens: &[u64]) -> Result<BTreeMap<u64, String>> {
    let mut unsupported = BTreeMap::new();
    for &h in hiddens {
        if let Some(why) = limits::row_unsupported_reason(target.kernels, h, target.dtype)? {
            unsupported.insert(h, why);
        }
    }
    Ok(unsupported)
}

/// The size cap (bytes of all-reduce input per rank) and where it comes from: the
/// override or the size table's entry. `None` (and the plan refused) when the table
/// has no entry.
fn size_cap(plan: &mut Plan, target: &Target) -> Option<(u64, String)> {
    let (sm, w) = (target.sm, target.world_size);
    match target.max_bytes_override {
        Some(b) => Some((b, "max_bytes_override".to_string())),
        None => match limits::max_bytes_entry(sm, w) {
            Some(b) => Some((b, format!("the size table entry for SM {sm} W={w}"))),
            None => {
                refuse(
                    plan,
                    format!(
                        "the size table has no entry for SM {sm} W={w}, so no \
                         size is known to be safe and fast; set max_bytes_override to fuse \
                         anyway"
                    ),
                );
                None
            }
        },
    }
}

/// A reason the whole plan is refused (no fusion).
struct Refusal(String);

/// What sizing and dispatch of one plan depend on.
struct Shape<'a> {
    target: &'a Target,
    backend: Backend,
    hiddens: &'a [u64],
    unsupported: &'a BTreeMap<u64, String>,
    /// The workspace's (widest supported) hidden size.
    h_ws: u64,
    /// max_token_num.
    m: u64,
    max_bytes: u64,
    t_max: u64,
}

impl Shape<'_> {
    fn ctx<'w>(&self, ws: &'w Workspace) -> Ctx<'w> {
        Ctx {
            kernels: ws.kernels,
            backend: self.backend,
            sm: self.target.sm,
            w: self.target.world_size,
            dtype: self.target.dtype,
            m: self.m,
            t_max: self.t_max,
            max_bytes: self.max_bytes,
            ws,
        }
    }

    /// The workspace the plan allocates, or `None` when no fused call can be sized.
    ///
    /// - FlashInfer's kernels: FlashInfer's default sizing for M (domain.md §5), or one
    ///   mnnvl buffer holding one-shot up to M in deterministic mode.
    /// - arfuse's kernels (deterministic or not: every strategy reduces in the contract's
    ///   order): exactly what the dispatch uses. The rule's strategy for every
    ///   (site, T) is found against the largest buffer the kernels allow
    ///   ([`limits::LAMPORT_MAX_COMM_BYTES`]), and ONE buffer is sized for the largest
    ///   of those calls. Every call the rule
    ///   picked needs at most that buffer, and every call it refused needs more than the
    ///   largest buffer, so dispatching again against the sized workspace makes the same
    ///   choices (the plan is verified after).
    fn size_workspace(&self) -> Result<Option<Workspace>> {
        let t = self.target;
        let (w, dtype) = (t.world_size, t.dtype);
        match t.kernels {
            KernelLibrary::Flashinfer if t.deterministic && self.backend == Backend::Mnnvl => {
                Workspace::flashinfer_mnnvl_one_shot_everywhere(w, self.h_ws, dtype, self.m)
                    .map(Some)
            }
            KernelLibrary::Flashinfer => {
                Workspace::flashinfer(self.backend, w, self.h_ws, dtype, self.m).map(Some)
            }
            KernelLibrary::Arfuse => {
                let need = {
                    let probe = Workspace::arfuse(
                        self.backend,
                        w,
                        self.h_ws,
                        dtype,
                        Some(self.m),
                        limits::LAMPORT_MAX_COMM_BYTES,
                    )?;
                    let ctx = self.ctx(&probe);
                    let mut need = None::<u64>;
                    for &h in self.supported() {
                        for r in ctx.site_ranges(h)? {
                            if r.strategy.is_fused() {
                                need = Some(need.unwrap_or(0).max(r.required_bytes_max));
                            }
                        }
                    }
                    need
                };
                let Some(need) = need else { return Ok(None) };
                let buffer = Workspace::arfuse_buffer_for(need)?;
                Workspace::arfuse(self.backend, w, self.h_ws, dtype, Some(self.m), buffer).map(Some)
            }
        }
    }

    /// The hidden sizes the kernels run, widest first.
    fn supported(&self) -> impl Iterator<Item = &u64> + '_ {
        self.hiddens
            .iter()
            .filter(|h| !self.unsupported.contains_key(h))
    }

    /// Every site's dispatch against `ws`.
    ///
    /// Deterministic mode: one reduction order for every T, i.e. one-shot (fixed rank
    /// order) everywhere, or no fusion at all (one-shot and two-shot reduce in different
    /// orders today; FlashInfer's two-shot cannot cover T < W), and unfused
    /// T mix in the all-reduce library's order.
    fn sites(&self, ws: &Workspace) -> std::result::Result<Vec<SiteDispatch>, PlanStep> {
        let ctx = self.ctx(ws);
        let mut sites = Vec::new();
        for &h in self.hiddens {
            let ranges = match self.unsupported.get(&h) {
                Some(why) if self.fixed_strategy() => {
                    return Err(PlanStep::deterministic_refusal(why.clone()))
                }
                Some(why) => vec![unfused_all(self.t_max, why)],
                None if self.fixed_strategy() => {
                    self.deterministic_blocker(ws, h)?;
                    let reason = format!(
                        "deterministic mode: one-shot (fixed rank-order reduction) for every \
                         T; it fits {}",
                        ctx.buffer_name(Strategy::OneShot)
                    );
                    vec![ctx.range(1, self.t_max, Strategy::OneShot, reason, h)?]
                }
                None => ctx.site_ranges(h)?,
            };
            sites.push(SiteDispatch { hidden: h, ranges });
        }
        Ok(sites)
    }

    /// Deterministic mode with kernels whose strategies reduce in different orders
    /// (FlashInfer's): one fused strategy for every T.
    fn fixed_strategy(&self) -> bool {
        self.target.deterministic && self.target.kernels == KernelLibrary::Flashinfer
    }

    /// Why deterministic mode cannot run one-shot for every T at `h` in `ws`.
    fn deterministic_blocker(&self, ws: &Workspace, h: u64) -> std::result::Result<(), PlanStep> {
        let (m, t_max) = (self.m, self.t_max);
        if m < t_max {
            return Err(PlanStep::deterministic_refusal(format!(
                "the graph can run with up to T={t_max} but only T <= max_token_num {m} \
                 may be fused, so some T would reduce in another order"
            )));
        }
        if ws.capacity_tokens(Strategy::OneShot, h)? < t_max {
            return Err(PlanStep::deterministic_refusal(format!(
                "one-shot at T={t_max}, H={h} needs {} bytes, more than one Lamport \
                 buffer of {} bytes",
                ws.required_bytes(Strategy::OneShot, t_max, h)?,
                ws.lamport_buffer_bytes
            )));
        }
        Ok(())
    }
}

/// Why a dispatch step stopped: an error, or a refusal of the whole plan.
enum PlanStep {
    Error(PolicyError),
    Refused(Refusal),
}

impl PlanStep {
    fn deterministic_refusal(why: String) -> PlanStep {
        PlanStep::Refused(Refusal(format!(
            "deterministic mode needs one reduction order for every T, and \
             {why}"
        )))
    }
}

impl From<PolicyError> for PlanStep {
    fn from(e: PolicyError) -> PlanStep {
        PlanStep::Error(e)
    }
}

fn check_given(
    ws: &Workspace,
    kernels: KernelLibrary,
    backend: Backend,
    w: u32,
    dtype: ActDtype,
    h: u64,
) -> Result<()> {
    let mismatch = |reason: String| Err(PolicyError::WorkspaceMismatch { reason });
    if ws.kernels != kernels {
        return mismatch(format!(
            "it is laid out for {}'s kernels but the target plans for {kernels}'s",
            ws.kernels
        ));
    }
    if ws.backend != backend {
        return mismatch(format!(
            "it belongs to {} but the target resolves to {backend}",
            ws.backend
        ));
    }
    if ws.world_size != w {
        return mismatch(format!(
            "it is for W={} but the group has W={w}",
            ws.world_size
        ));
    }
    if ws.dtype != dtype {
        return mismatch(format!(
            "it is for {} but the target uses {dtype}",
            ws.dtype
        ));
    }
    if ws.hidden < h {
        return mismatch(format!(
            "it was sized for H={} but a graph sharing it has H={h}; size one workspace for \
             the widest hidden size (a draft wider than its target overflowed a \
             target-sized workspace)",
            ws.hidden
        ));
    }
    let problems = ws.problems();
    if !problems.is_empty() {
        return mismatch(problems.join("; "));
    }
    Ok(())
}

fn finish(plan: &mut Plan, raw_points: Vec<(u64, PointSource)>) -> Result<()> {
    let mut points = Vec::with_capacity(raw_points.len());
    for (t, source) in raw_points {
        let strategy = plan.strategy_for(t)?;
        let beyond = t > plan.max_batched_tokens;
        if beyond {
            plan.notes.push(format!(
                "T={t} ({source}) exceeds max_batched_tokens {}; it is planned ({strategy}) \
                 but the engine should not produce it",
                plan.max_batched_tokens
            ));
        }
        points.push(TokenPoint {
            t,
            source,
            strategy,
            beyond_max_batched_tokens: beyond,
        });
    }
    plan.points = points;
    Ok(())
}

impl Plan {
    /// The backend, when fusing.
    pub fn backend(&self) -> Option<Backend> {
        self.decision.backend()
    }

    /// The workspace's hidden size: the widest planned (elements).
    pub fn hidden(&self) -> u64 {
        self.sites.first().map_or(0, |s| s.hidden)
    }

    /// The dispatch at the widest hidden size.
    pub fn dispatch(&self) -> &[DispatchRange] {
        self.sites.first().map_or(&[], |s| &s.ranges)
    }

    /// The strategy for a call of `t` tokens at the widest hidden size.
    ///
    /// Errors: [`PolicyError::InvalidTokens`] for T = 0 or T beyond the planned range.
    pub fn strategy_for(&self, t: u64) -> Result<Strategy> {
        lookup(self.dispatch(), t, self.max_planned_tokens).map(|r| r.strategy)
    }

    /// The strategy for a call of `t` tokens at a site of hidden size `hidden`
    /// (see [`Plan::dispatch_for_hidden`]).
    ///
    /// Errors: as [`Plan::dispatch_for_hidden`] and [`Plan::strategy_for`].
    pub fn strategy_for_hidden(&self, hidden: u64, t: u64) -> Result<Strategy> {
        let ranges = self.dispatch_for_hidden(hidden)?;
        lookup(&ranges, t, self.max_planned_tokens).map(|r| r.strategy)
    }

    /// Whether the fused kernel for `t` tokens (widest H) must trigger PDL completion
    /// at its end ([`strategy::trigger_completion_at_end`]).
    ///
    /// Errors: as [`Plan::strategy_for`].
    pub fn trigger_completion_at_end(&self, t: u64) -> Result<bool> {
        Ok(strategy::trigger_completion_at_end(
            self.strategy_for(t)?,
            t,
        ))
    }

    /// The dispatch for a fused site of hidden size `hidden` (elements) sharing this
    /// plan's workspace: same max_token_num and buffers, strategy rules evaluated at
    /// `hidden`. Sizes given to [`plan`] return their stored dispatch.
    ///
    /// Errors: [`PolicyError::InvalidHidden`] (H = 0 or too large);
    /// [`PolicyError::WorkspaceMismatch`] when `hidden` exceeds the workspace's hidden
    /// size (plan again with it included); [`PolicyError::Overflow`].
    pub fn dispatch_for_hidden(&self, hidden: u64) -> Result<Vec<DispatchRange>> {
        limits::check_hidden(hidden, self.dtype)?;
        if let Some(site) = self.sites.iter().find(|s| s.hidden == hidden) {
            return Ok(site.ranges.clone());
        }
        let (Some(backend), Some(ws), Some(max_bytes)) =
            (self.backend(), self.workspace.as_ref(), self.max_bytes)
        else {
            return Ok(vec![unfused_all(
                self.max_planned_tokens,
                self.decision.reason(),
            )]);
        };
        if hidden > ws.hidden {
            return Err(PolicyError::WorkspaceMismatch {
                reason: format!(
                    "a site of H={hidden} cannot share a workspace sized for H={}; include it \
                     in the hidden sizes given to plan()",
                    ws.hidden
                ),
            });
        }
        if let Some(why) = limits::row_unsupported_reason(self.kernels, hidden, self.dtype)? {
            return Ok(vec![unfused_all(self.max_planned_tokens, &why)]);
        }
        let ctx = Ctx {
            kernels: self.kernels,
            backend,
            sm: self.sm,
            w: self.world_size,
            dtype: self.dtype,
            m: self.max_token_num,
            t_max: self.max_planned_tokens,
            max_bytes,
            ws,
        };
        if self.deterministic && self.kernels == KernelLibrary::Flashinfer {
            // Capacity shrinks with H, so the widest site's one-shot-everywhere proof
            // covers a narrower one.
            let reason = format!(
                "deterministic mode: one-shot (fixed rank-order reduction) for every T; it \
                 fits {}",
                ctx.buffer_name(Strategy::OneShot)
            );
            return Ok(vec![ctx.range(
                1,
                self.max_planned_tokens,
                Strategy::OneShot,
                reason,
                hidden,
            )?]);
        }
        ctx.site_ranges(hidden)
    }

    /// A copy of the plan in which every site runs `strategy` for T in `lo..=hi`
    /// (reason "forced from outside"), for what-if checks and for plans an engine
    /// imposes. The copy is NOT verified: pass it to [`crate::verify`].
    ///
    /// Errors: [`PolicyError::InvalidTokens`] when `lo` = 0 or `lo > hi`;
    /// [`PolicyError::Overflow`].
    pub fn with_strategy(&self, lo: u64, hi: u64, strategy: Strategy) -> Result<Plan> {
        if lo == 0 || lo > hi {
            return Err(PolicyError::InvalidTokens {
                t: lo,
                reason: format!("forced range {lo}..={hi} must satisfy 1 <= lo <= hi"),
            });
        }
        let mut out = self.clone();
        for site in &mut out.sites {
            let h = site.hidden;
            let mut ranges = Vec::new();
            for r in &site.ranges {
                if r.hi < lo || r.lo > hi {
                    ranges.push(r.clone());
                    continue;
                }
                if r.lo < lo {
                    ranges.push(self.make_range(r.lo, lo - 1, r.strategy, r.reason.clone(), h)?);
                }
                if r.hi > hi {
                    ranges.push(self.make_range(hi + 1, r.hi, r.strategy, r.reason.clone(), h)?);
                }
            }
            ranges.push(self.make_range(lo, hi, strategy, "forced from outside".to_string(), h)?);
            ranges.sort_by_key(|r| r.lo);
            site.ranges = ranges;
        }
        out.notes
            .push(format!("forced {strategy} for T={lo}..={hi} from outside"));
        Ok(out)
    }

    fn make_range(
        &self,
        lo: u64,
        hi: u64,
        s: Strategy,
        reason: String,
        h: u64,
    ) -> Result<DispatchRange> {
        dispatch_range(self.workspace.as_ref(), lo, hi, s, reason, h)
    }

    /// Verifies the plan against its own workspace (see [`crate::verify`]); a plan
    /// without a workspace may not fuse any T.
    pub fn verify_own(&self) -> Vec<Violation> {
        verify_inner(self, self.workspace.as_ref())
    }

    /// A multi-line report: decision, workspace, dispatch per hidden size, notes.
    pub fn summary(&self) -> String {
        self.to_string()
    }
}

fn lookup(ranges: &[DispatchRange], t: u64, t_max: u64) -> Result<&DispatchRange> {
    if t == 0 {
        return Err(PolicyError::InvalidTokens {
            t,
            reason: "a call has at least one token".to_string(),
        });
    }
    ranges
        .iter()
        .find(|r| r.contains(t))
        .ok_or_else(|| PolicyError::InvalidTokens {
            t,
            reason: format!("not planned: the plan covers T=1..={t_max}"),
        })
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "arfuse plan: SM {}, W={}, {}{}",
            self.sm,
            self.world_size,
            self.dtype,
            if self.deterministic {
                ", deterministic"
            } else {
                ""
            }
        )?;
        writeln!(f, "  decision: {}", self.decision)?;
        if let Some(ws) = &self.workspace {
            writeln!(f, "  max_token_num: {}", self.max_token_num)?;
            writeln!(f, "  workspace: {ws}")?;
        }
        if let (Some(ws), Some(fi)) = (&self.workspace, &self.flashinfer_workspace) {
            writeln!(
                f,
                "  FlashInfer's sizing would allocate {} bytes per rank (arfuse / FlashInfer = {:.4})",
                fi.total_bytes_per_rank,
                ws.total_bytes_per_rank as f64 / fi.total_bytes_per_rank as f64
            )?;
        }
        for site in &self.sites {
            writeln!(f, "  H={}:", site.hidden)?;
            for r in &site.ranges {
                writeln!(f, "    {r}")?;
            }
        }
        for n in &self.notes {
            writeln!(f, "  note: {n}")?;
        }
        Ok(())
    }
}

/// A range `lo..=hi` run with `s`, with the bytes of one call at `hi` and the bytes
/// available to it in `ws` (both 0 when unfused or without a workspace).
fn dispatch_range(
    ws: Option<&Workspace>,
    lo: u64,
    hi: u64,
    s: Strategy,
    reason: String,
    h: u64,
) -> Result<DispatchRange> {
    let (required_bytes_max, available_bytes) = match ws {
        Some(ws) if s.is_fused() => (ws.required_bytes(s, hi, h)?, ws.available_bytes(s)),
        _ => (0, 0),
    };
    Ok(DispatchRange {
        lo,
        hi,
        strategy: s,
        required_bytes_max,
        available_bytes,
        reason,
    })
}
