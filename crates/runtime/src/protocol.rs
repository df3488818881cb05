//! Host model of the kernels' synchronisation protocols: Rust threads play the ranks,
//! with the same buffer layouts, sentinels and counters as `kernels/allreduce_fused.cu`
//! (one CTA per rank; the kernels run the same protocol independently per CTA index).
//!
//! - One-shot Lamport: three rotating buffers per rank, slot per source rank, -0.0
//!   (`0x8000`) as the "empty" sentinel tested bitwise, -0.0 inputs written as +0.0,
//!   the buffer of the previous call re-filled with the sentinel, a per-rank call
//!   counter and per-buffer "bytes used" bookkeeping.
//! - Two-shot: reduce-scatter into slot `rank` of the owner's current Lamport buffer
//!   (the first `T % W` ranks own one extra token), the owner polls, reduces in rank
//!   order and all-gathers into every rank's gather rows of the same buffer, which
//!   every rank polls. Both strategies share one call counter and the buffer rotation,
//!   so strategy and T may change between any two calls (two-shot with T < W too: the
//!   ranks without a token still push to the owners and poll the gathered rows).
//!
//! Every wait has a deadline, so a protocol bug fails with [`Error::Model`] instead
//! of hanging. The model works on bf16 (bits in `AtomicU16`), reducing in fp32 in
//! fixed rank order from +0.0 and rounding with the `half` crate, which is the
//! kernels' rounding contract (`kernels/arfuse_common.cuh`).
//!
//! For the lead: [`model_allreduce`] returns the model's all-reduce result for one
//! call, to be compared with `arfuse-reference`; [`allreduce_reference`] is the plain
//! fixed-order sum it must equal bit for bit.

use crate::error::{Error, Result};
use crate::variants::Strategy;
use half::bf16;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The "empty" bit pattern of a bf16 Lamport element (-0.0).
pub const SENTINEL_BF16: u16 = 0x8000;

/// How a rank decides that a Lamport element is still empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SentinelCheck {
    /// Bitwise `bits == 0x8000` (what the kernels do).
    Bitwise,
    /// Fault injection: a float compare under flush-to-zero (`ftz(x) == -0.0` with
    /// the sign tested), the public bug: a negative subnormal input reads as empty
    /// forever. Tests use it to show the model catches hangs.
    FloatFtz,
}

/// Model configuration.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// World size W (any W >= 1; the kernels support 2, 4, 8, 16).
    pub world: usize,
    /// Hidden size H (elements per token).
    pub hidden: usize,
    /// Tokens the workspace is sized for (M).
    pub max_tokens: usize,
    /// How long a rank may wait for any one condition. Default 10 s.
    pub timeout: Duration,
    /// Sentinel test. Default [`SentinelCheck::Bitwise`].
    pub sentinel_check: SentinelCheck,
}

impl ModelConfig {
    /// A configuration with the defaults above.
    pub fn new(world: usize, hidden: usize, max_tokens: usize) -> ModelConfig {
        ModelConfig {
            world,
            hidden,
            max_tokens,
            timeout: Duration::from_secs(10),
            sentinel_check: SentinelCheck::Bitwise,
        }
    }
}

/// One all-reduce call: the strategy and every rank's input (`[T, H]` row-major).
#[derive(Debug, Clone)]
pub struct Call {
    /// Strategy of this call (may change from call to call).
    pub strategy: Strategy,
    /// Tokens T.
    pub tokens: usize,
    /// `inputs[r]` is rank r's input, `tokens * hidden` values.
    pub inputs: Vec<Vec<bf16>>,
}

/// The memory of one rank, laid out like the kernels' workspace (in elements).
struct RankMem {
    /// Three Lamport buffers of `max(W * M, W * ceil(M / W) + M) * H` elements each.
    lamport: [Vec<AtomicU16>; 3],
    /// Call counter n (buffer n % 3 is current), shared by both strategies.
    call: AtomicU32,
    /// Elements written into each Lamport buffer by the call that used it.
    used: [AtomicUsize; 3],
}

/// A workspace shared by W rank threads; it persists across [`Model::run`] calls so
/// buffer rotation and counters carry over like a real workspace.
pub struct Model {
    cfg: ModelConfig,
    ranks: Vec<RankMem>,
}

fn atomics(n: usize, v: u16) -> Vec<AtomicU16> {
    (0..n).map(|_| AtomicU16::new(v)).collect()
}

/// Token ownership of the two-shot strategy: first token owned by rank `o`.
pub fn owner_start(o: usize, tokens: usize, world: usize) -> usize {
    let base = tokens / world;
    let rem = tokens % world;
    o * base + o.min(rem)
}

/// Token ownership of the two-shot strategy: the rank that owns token `t`.
pub fn owner_of(t: usize, tokens: usize, world: usize) -> usize {
    let base = tokens / world;
    let rem = tokens % world;
    let big = rem * (base + 1);
    if t < big {
        t / (base + 1)
    } else {
        rem + (t - big) / base.max(1)
    }
}

/// The contract every strategy must meet bit for bit: per element,
/// `bf16(((0.0f32 + x_0) + x_1) + ... + x_{W-1})`, fp32 in fixed rank order,
/// rounded to nearest even. Starting from +0.0 makes an all -0.0 column +0.0 (the
/// Lamport transport writes -0.0 as +0.0; this cannot change a sum that starts at +0).
pub fn allreduce_reference(inputs: &[Vec<bf16>]) -> Vec<bf16> {
    let n = inputs.first().map_or(0, Vec::len);
    (0..n)
        .map(|i| {
            let mut acc = 0.0f32;
            for x in inputs {
                acc += x[i].to_f32();
            }
            bf16::from_f32(acc)
        })
        .collect()
}

/// Runs one call of `strategy` on a fresh model and returns the all-reduce result
/// (identical on every rank, checked). This is the function to compare with
/// `arfuse-reference`.
///
/// # Errors
/// [`Error::Invalid`] for inconsistent shapes, [`Error::Model`] when a rank timed out
/// or ranks disagree.
pub fn model_allreduce(
    strategy: Strategy,
    hidden: usize,
    inputs: &[Vec<bf16>],
) -> Result<Vec<bf16>> {
    let world = inputs.len();
    if world == 0 || hidden == 0 {
        return Err(Error::Invalid(
            "model_allreduce needs W >= 1 and H >= 1".into(),
        ));
    }
    let tokens = inputs[0].len() / hidden;
    let model = Model::new(ModelConfig::new(world, hidden, tokens.max(1)))?;
    let out = model.run(&[Call {
        strategy,
        tokens,
        inputs: inputs.to_vec(),
    }])?;
    Ok(out
        .into_iter()
        .next()
        .and_then(|c| c.into_iter().next())
        .unwrap_or_default())
}

struct Waiter<'a> {
    deadline_len: Duration,
    abort: &'a AtomicBool,
}

impl Waiter<'_> {
    /// Spins until `ready()` or the deadline; yields the CPU between polls.
    fn wait(&self, what: &dyn Fn() -> String, mut ready: impl FnMut() -> bool) -> Result<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        while !ready() {
            spins = spins.wrapping_add(1);
            if spins & 63 == 0 {
                if self.abort.load(Ordering::Relaxed) {
                    return Err(Error::Model(format!(
                        "aborted while waiting for {}",
                        what()
                    )));
                }
                if start.elapsed() > self.deadline_len {
                    self.abort.store(true, Ordering::Relaxed);
                    return Err(Error::Model(format!(
                        "timeout after {:?} waiting for {}",
                        self.deadline_len,
                        what()
                    )));
                }
            }
            std::thread::yield_now();
        }
        Ok(())
    }
}

impl Model {
    /// Creates the workspace: Lamport buffers filled with the sentinel, everything
    /// else zero.
    ///
    /// # Errors
    /// [`Error::Invalid`] for W, H or M of 0; [`Error::Overflow`] for absurd sizes.
    pub fn new(cfg: ModelConfig) -> Result<Model> {
        if cfg.world == 0 || cfg.hidden == 0 || cfg.max_tokens == 0 {
            return Err(Error::Invalid("model needs W, H, M >= 1".into()));
        }
        let w = cfg.world;
        let m = cfg.max_tokens;
        let rows = w
            .checked_mul(m)
            .max(w.checked_mul(m.div_ceil(w)).and_then(|x| x.checked_add(m)))
            .ok_or(Error::Overflow("model Lamport buffer"))?;
        let lam = rows
            .checked_mul(cfg.hidden)
            .ok_or(Error::Overflow("model Lamport buffer"))?;
        let ranks = (0..w)
            .map(|_| RankMem {
                lamport: [
                    atomics(lam, SENTINEL_BF16),
                    atomics(lam, SENTINEL_BF16),
                    atomics(lam, SENTINEL_BF16),
                ],
                call: AtomicU32::new(0),
                used: [
                    AtomicUsize::new(0),
                    AtomicUsize::new(0),
                    AtomicUsize::new(0),
                ],
            })
            .collect();
        Ok(Model { cfg, ranks })
    }

    /// Whether every element of every Lamport buffer not in use holds the sentinel
    /// (the invariant that makes the next calls safe). Call between runs.
    pub fn lamport_clean_except_last(&self) -> bool {
        self.ranks.iter().all(|m| {
            let n = m.call.load(Ordering::Acquire);
            let last = (n + 2) % 3; // buffer of the last call, cleared by the next
            (0..3u32).filter(|b| *b != last).all(|b| {
                m.lamport[b as usize]
                    .iter()
                    .all(|x| x.load(Ordering::Relaxed) == SENTINEL_BF16)
            })
        })
    }

    /// Runs `calls` in order on W threads (one per rank) and returns
    /// `out[call][rank]`, each `tokens * hidden` values.
    ///
    /// # Errors
    /// [`Error::Invalid`] when a call does not fit the workspace or has the wrong
    /// shape; [`Error::Model`] when any rank timed out (the others abort too).
    pub fn run(&self, calls: &[Call]) -> Result<Vec<Vec<Vec<bf16>>>> {
        let w = self.cfg.world;
        for (k, c) in calls.iter().enumerate() {
            if c.tokens > self.cfg.max_tokens {
                return Err(Error::Invalid(format!(
                    "call {k}: T={} exceeds the workspace (M={})",
                    c.tokens, self.cfg.max_tokens
                )));
            }
            if c.inputs.len() != w
                || c.inputs
                    .iter()
                    .any(|x| x.len() != c.tokens * self.cfg.hidden)
            {
                return Err(Error::Invalid(format!(
                    "call {k}: inputs must be W x T x H"
                )));
            }
        }
        let abort = Arc::new(AtomicBool::new(false));
        let results: Vec<Result<Vec<Vec<bf16>>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..w)
                .map(|r| {
                    let abort = Arc::clone(&abort);
                    s.spawn(move || {
                        let waiter = Waiter {
                            deadline_len: self.cfg.timeout,
                            abort: &abort,
                        };
                        let mut outs = Vec::with_capacity(calls.len());
                        for (k, c) in calls.iter().enumerate() {
                            let out = match c.strategy {
                                Strategy::OneShot => self.oneshot(r, c, &waiter),
                                Strategy::TwoShot => self.twoshot(r, c, &waiter),
                            }
                            .map_err(|e| {
                                Error::Model(format!("rank {r}, call {k} ({:?}): {e}", c.strategy))
                            })?;
                            outs.push(out);
                        }
                        Ok(outs)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Model("a rank thread panicked".into())))
                })
                .collect()
        });
        let mut per_rank = Vec::with_capacity(w);
        for r in results {
            per_rank.push(r?);
        }
        // Transpose to out[call][rank].
        let mut out: Vec<Vec<Vec<bf16>>> =
            (0..calls.len()).map(|_| Vec::with_capacity(w)).collect();
        for rank_out in per_rank {
            for (k, o) in rank_out.into_iter().enumerate() {
                out[k].push(o);
            }
        }
        Ok(out)
    }

    fn is_empty(&self, bits: u16) -> bool {
        match self.cfg.sentinel_check {
            SentinelCheck::Bitwise => bits == SENTINEL_BF16,
            SentinelCheck::FloatFtz => {
                let f = bf16::from_bits(bits).to_f32();
                let flushed = if f.is_subnormal() {
                    0.0f32.copysign(f)
                } else {
                    f
                };
                flushed == 0.0 && flushed.is_sign_negative()
            }
        }
    }

    /// Starts a call of rank `r`: its number n, and the previous call's buffer re-filled
    /// with the sentinel (mirrors `arf_call_begin`).
    fn begin(&self, r: usize) -> u32 {
        let me = &self.ranks[r];
        let n = me.call.load(Ordering::Acquire);
        let prev = ((n + 2) % 3) as usize;
        let prev_used = me.used[prev].load(Ordering::Acquire);
        for e in &me.lamport[prev][..prev_used] {
            e.store(SENTINEL_BF16, Ordering::Relaxed);
        }
        n
    }

    /// Ends call `n` of rank `r`, which wrote `used` elements into its buffer (mirrors
    /// `arf_call_end`).
    fn end(&self, r: usize, n: u32, used: usize) {
        let me = &self.ranks[r];
        me.used[((n + 2) % 3) as usize].store(0, Ordering::Release);
        me.used[(n % 3) as usize].store(used, Ordering::Release);
        me.call.store(n.wrapping_add(1), Ordering::Release);
    }

    /// Polls one element of rank `r`'s buffer until it holds no sentinel.
    fn poll(
        &self,
        cell: &AtomicU16,
        waiter: &Waiter<'_>,
        what: &dyn Fn() -> String,
    ) -> Result<u16> {
        let mut bits = cell.load(Ordering::Acquire);
        if self.is_empty(bits) {
            waiter.wait(what, || {
                bits = cell.load(Ordering::Acquire);
                !self.is_empty(bits)
            })?;
        }
        Ok(bits)
    }

    /// -0.0 travels as +0.0: -0.0 is the sentinel.
    fn scrub(x: bf16) -> u16 {
        let bits = x.to_bits();
        if bits == SENTINEL_BF16 {
            0
        } else {
            bits
        }
    }

    /// One-shot Lamport call of rank `r` (mirrors `arf_oneshot`).
    fn oneshot(&self, r: usize, c: &Call, waiter: &Waiter<'_>) -> Result<Vec<bf16>> {
        let w = self.cfg.world;
        let slot = c.tokens * self.cfg.hidden;
        let n = self.begin(r);
        let cur = (n % 3) as usize;
        // 1. Push.
        for peer in &self.ranks {
            for (i, x) in c.inputs[r].iter().enumerate() {
                peer.lamport[cur][r * slot + i].store(Self::scrub(*x), Ordering::Release);
            }
        }
        // 2. Poll and reduce in rank order from +0.0.
        let me = &self.ranks[r];
        let mut out = Vec::with_capacity(slot);
        for i in 0..slot {
            let mut acc = 0.0f32;
            for s in 0..w {
                let bits = self.poll(&me.lamport[cur][s * slot + i], waiter, &|| {
                    format!("one-shot slot {s} element {i} (buffer {cur})")
                })?;
                acc += bf16::from_bits(bits).to_f32();
            }
            out.push(bf16::from_f32(acc));
        }
        self.end(r, n, w * slot);
        Ok(out)
    }

    /// Two-shot Lamport call of rank `r` (mirrors `arf_twoshot`): scatter rows
    /// `[0, W * R)` (slot s = rows s * R ..), gather rows `[W * R, W * R + T)`, R =
    /// ceil(T / W).
    fn twoshot(&self, r: usize, c: &Call, waiter: &Waiter<'_>) -> Result<Vec<bf16>> {
        let w = self.cfg.world;
        let h = self.cfg.hidden;
        let t_n = c.tokens;
        let rows = t_n.div_ceil(w);
        let n = self.begin(r);
        let cur = (n % 3) as usize;
        // 1. Reduce-scatter push into slot r of the owner's buffer.
        for t in 0..t_n {
            let o = owner_of(t, t_n, w);
            let row = r * rows + t - owner_start(o, t_n, w);
            for i in 0..h {
                self.ranks[o].lamport[cur][row * h + i]
                    .store(Self::scrub(c.inputs[r][t * h + i]), Ordering::Release);
            }
        }
        // 2. Poll the owned rows, reduce in rank order, all-gather the rounded sums.
        let me = &self.ranks[r];
        let (start, end) = (owner_start(r, t_n, w), owner_start(r + 1, t_n, w));
        for t in start..end {
            for i in 0..h {
                let mut acc = 0.0f32;
                for s in 0..w {
                    let cell = &me.lamport[cur][(s * rows + t - start) * h + i];
                    let bits = self.poll(cell, waiter, &|| {
                        format!("two-shot scatter slot {s} token {t} (buffer {cur})")
                    })?;
                    acc += bf16::from_bits(bits).to_f32();
                }
                let bits = bf16::from_f32(acc).to_bits();
                for peer in &self.ranks {
                    peer.lamport[cur][(w * rows + t) * h + i].store(bits, Ordering::Release);
                }
            }
        }
        // 3. Poll every gathered row.
        let mut out = Vec::with_capacity(t_n * h);
        for k in 0..t_n * h {
            let cell = &me.lamport[cur][w * rows * h + k];
            let bits = self.poll(cell, waiter, &|| {
                format!("two-shot gather element {k} (buffer {cur})")
            })?;
            out.push(bf16::from_bits(bits));
        }
        self.end(r, n, (w * rows + t_n) * h);
        Ok(out)
    }
}

/// Host mirror of the kernels' residual + RMSNorm epilogue for bf16 (the contract in
/// `kernels/arfuse_common.cuh`), on `[T, H]` row-major data: returns
/// `(residual_out, norm_out)`. `a` is the all-reduce output (already rounded). The
/// sum of squares is sequential here and block-tree ordered on the GPU, so norm_out
/// may differ by 1 ulp; residual_out must match bit for bit.
pub fn res_norm_reference(
    a: &[bf16],
    residual: Option<&[bf16]>,
    gamma: &[bf16],
    eps: f32,
    weight_bias: f32,
) -> (Vec<bf16>, Vec<bf16>) {
    let h = gamma.len().max(1);
    let res_out: Vec<bf16> = match residual {
        Some(r) => a
            .iter()
            .zip(r)
            .map(|(x, y)| bf16::from_f32(x.to_f32() + y.to_f32()))
            .collect(),
        None => a.to_vec(),
    };
    let mut norm = Vec::with_capacity(res_out.len());
    for row in res_out.chunks(h) {
        let ss: f32 = row.iter().map(|x| x.to_f32() * x.to_f32()).sum();
        let rstd = 1.0 / (ss / h as f32 + eps).sqrt();
        for (x, g) in row.iter().zip(gamma) {
            norm.push(bf16::from_f32(
                (x.to_f32() * rstd) * (g.to_f32() + weight_bias),
            ));
        }
    }
    (res_out, norm)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: deterministic inputs without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        /// Mostly normal values in [-4, 4), with -0.0, +0.0 and negative / positive
        /// subnormals mixed in.
        fn value(&mut self) -> bf16 {
            match self.next() % 16 {
                0 => bf16::from_bits(0x8000),                               // -0.0
                1 => bf16::from_bits(0x8001 + (self.next() % 0x7f) as u16), // negative subnormal
                2 => bf16::from_bits(0x0001 + (self.next() % 0x7f) as u16), // positive subnormal
                3 => bf16::from_bits(0),
                _ => bf16::from_f32(((self.next() % 65536) as f32 / 8192.0) - 4.0),
            }
        }
    }

    fn inputs(rng: &mut Rng, w: usize, t: usize, h: usize) -> Vec<Vec<bf16>> {
        (0..w)
            .map(|_| (0..t * h).map(|_| rng.value()).collect())
            .collect()
    }

    fn check_calls(w: usize, h: usize, m: usize, plan: &[(Strategy, usize)], seed: u64) {
        let mut rng = Rng(seed);
        let model = Model::new(ModelConfig::new(w, h, m)).unwrap();
        let calls: Vec<Call> = plan
            .iter()
            .map(|&(strategy, tokens)| Call {
                strategy,
                tokens,
                inputs: inputs(&mut rng, w, tokens, h),
            })
            .collect();
        let out = model.run(&calls).unwrap();
        for (k, c) in calls.iter().enumerate() {
            let want: Vec<u16> = allreduce_reference(&c.inputs)
                .iter()
                .map(|x| x.to_bits())
                .collect();
            for (r, o) in out[k].iter().enumerate() {
                let got: Vec<u16> = o.iter().map(|x| x.to_bits()).collect();
                assert_eq!(
                    got, want,
                    "W={w} call {k} {:?} T={} rank {r}",
                    c.strategy, c.tokens
                );
            }
        }
        assert!(
            model.lamport_clean_except_last(),
            "stale data left in Lamport buffers"
        );
    }

    #[test]
    fn reference_sum_is_fixed_order_from_plus_zero() {
        let neg0 = bf16::from_bits(0x8000);
        assert_eq!(
            allreduce_reference(&[vec![neg0], vec![neg0]])[0].to_bits(),
            0x0000
        );
        // Fixed order matters: (1 + 2^-8) + (-1) in fp32 then bf16.
        let a = [
            bf16::from_f32(1.0),
            bf16::from_f32(0.00390625),
            bf16::from_f32(-1.0),
        ];
        let got = allreduce_reference(&[vec![a[0]], vec![a[1]], vec![a[2]]]);
        assert_eq!(got[0].to_f32(), 0.00390625);
        let sub = bf16::from_bits(0x8001);
        assert_eq!(
            allreduce_reference(&[vec![sub], vec![bf16::ZERO]])[0].to_bits(),
            0x8001
        );
    }

    #[test]
    fn ownership_gives_first_ranks_the_extra_token() {
        // T = 42, W = 8: ranks 0, 1 own 6 tokens, ranks 2..8 own 5.
        let starts: Vec<usize> = (0..=8).map(|o| owner_start(o, 42, 8)).collect();
        assert_eq!(starts, vec![0, 6, 12, 17, 22, 27, 32, 37, 42]);
        for t in 0..42 {
            let o = owner_of(t, 42, 8);
            assert!(starts[o] <= t && t < starts[o + 1], "token {t} -> {o}");
        }
        // T < W: the first T ranks own one token each.
        assert_eq!(
            (0..3).map(|t| owner_of(t, 3, 8)).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(owner_start(8, 3, 8), 3);
    }

    #[test]
    fn oneshot_many_calls_rotate_three_buffers() {
        for w in [2, 4, 8] {
            let plan: Vec<(Strategy, usize)> = [1, 7, 16, 3, 16, 1, 9, 2, 16, 5, 4, 12]
                .iter()
                .map(|&t| (Strategy::OneShot, t))
                .collect();
            check_calls(w, 24, 16, &plan, 0x5eed + w as u64);
        }
    }

    #[test]
    fn twoshot_many_calls_with_changing_t_including_t_below_w() {
        for w in [2, 4, 8] {
            let plan: Vec<(Strategy, usize)> = [1, 7, 16, 40, 42, 3, 42, 8]
                .iter()
                .map(|&t| (Strategy::TwoShot, t))
                .collect();
            check_calls(w, 16, 42, &plan, 0xabc + w as u64);
        }
    }

    /// Both strategies share one rotation: any sequence of strategies and T keeps every
    /// rank's buffers in step.
    #[test]
    fn alternating_strategies_share_one_rotation() {
        for w in [2, 4, 8] {
            let mut plan = Vec::new();
            for k in 0..14 {
                let t = 1 + (k * 5) % 16;
                let s = if k % 3 == 1 {
                    Strategy::TwoShot
                } else {
                    Strategy::OneShot
                };
                plan.push((s, t));
            }
            check_calls(w, 8, 16, &plan, 0x77 + w as u64);
        }
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn negative_zero_and_negative_subnormal_inputs_never_hang() {
        let w = 4;
        let h = 8;
        let neg0 = bf16::from_bits(0x8000);
        let nsub = bf16::from_bits(0x8001);
        let model = Model::new(ModelConfig::new(w, h, 4)).unwrap();
        let mk = |v: bf16, s| Call {
            strategy: s,
            tokens: 4,
            inputs: vec![vec![v; 4 * h]; w],
        };
        let calls = vec![
            mk(neg0, Strategy::OneShot),
            mk(nsub, Strategy::OneShot),
            mk(neg0, Strategy::TwoShot),
            mk(nsub, Strategy::TwoShot),
            mk(neg0, Strategy::OneShot),
        ];
        let out = model.run(&calls).unwrap();
        for r in 0..w {
            assert!(
                out[0][r].iter().all(|x| x.to_bits() == 0x0000),
                "all -0.0 sums to +0.0"
            );
            // 4 x (-2^-133) in fp32 = -2^-131 = bf16 0x8004.
            assert!(
                out[1][r].iter().all(|x| x.to_bits() == 0x8004),
                "{:?}",
                out[1][r][0]
            );
            assert!(out[2][r].iter().all(|x| x.to_bits() == 0x0000));
            assert!(out[3][r].iter().all(|x| x.to_bits() == 0x8004));
            assert!(out[4][r].iter().all(|x| x.to_bits() == 0x0000));
        }
    }

    #[test]
    fn float_ftz_sentinel_test_hangs_and_the_model_reports_it() {
        let w = 2;
        let h = 8;
        let mut cfg = ModelConfig::new(w, h, 1);
        cfg.timeout = Duration::from_millis(300);
        cfg.sentinel_check = SentinelCheck::FloatFtz;
        let model = Model::new(cfg).unwrap();
        let start = Instant::now();
        let err = model
            .run(&[Call {
                strategy: Strategy::OneShot,
                tokens: 1,
                inputs: vec![vec![bf16::from_bits(0x8001); h]; w],
            }])
            .unwrap_err();
        assert!(
            matches!(err, Error::Model(ref m) if m.contains("timeout") || m.contains("aborted")),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn model_allreduce_matches_reference_for_both_strategies() {
        let mut rng = Rng(99);
        let ins = inputs(&mut rng, 8, 42, 16);
        let want: Vec<u16> = allreduce_reference(&ins)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        for s in [Strategy::OneShot, Strategy::TwoShot] {
            let got: Vec<u16> = model_allreduce(s, 16, &ins)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            assert_eq!(got, want, "{s:?}");
        }
        assert!(matches!(
            model_allreduce(Strategy::OneShot, 0, &ins),
            Err(Error::Invalid(_))
        ));
    }

    #[test]
    fn oversized_call_is_refused() {
        let model = Model::new(ModelConfig::new(2, 8, 4)).unwrap();
        let err = model
            .run(&[Call {
                strategy: Strategy::OneShot,
                tokens: 5,
                inputs: vec![vec![bf16::ZERO; 40]; 2],
            }])
            .unwrap_err();
        assert!(matches!(err, Error::Invalid(_)));
    }
}
