//! Real ranks: a group of W processes (one rank each) that workspaces are created
//! across, and the all-or-nothing step every collective creation is made of.
//!
//! [`Group`] is what the runtime needs of the engine's process group: the rank, the
//! world size, an all-gather of bytes and (from it) a barrier and a broadcast. The
//! Python package implements it over `torch.distributed` (the engine's own group);
//! [`SocketGroup`] implements it over a Unix socket on this machine for Rust programs
//! and tests that run W real processes.
//!
//! Every operation of a group is bounded in time: a peer that died or never comes ends
//! it with [`Error::Group`], never a hang.

use crate::error::{Error, Result};
use crate::workspace::Backend;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

/// Largest message one rank contributes to an all-gather, bytes (workspace handles and
/// status lines are far smaller; a larger frame is a protocol error, not an allocation).
pub const MAX_GATHER_BYTES: usize = 1 << 20;

/// The process group the ranks of a workspace belong to.
pub trait Group {
    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> u32;
    /// Number of ranks W.
    fn world_size(&self) -> u32;
    /// Every rank's `mine`, in rank order (W entries; entry `rank()` is `mine`).
    /// Collective: every rank calls it, in the same order as its other collectives.
    ///
    /// # Errors
    /// [`Error::Group`] when a peer is gone or does not answer within the group's
    /// timeout, or a message exceeds [`MAX_GATHER_BYTES`].
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;

    /// Returns when every rank called it.
    ///
    /// # Errors
    /// As [`Group::all_gather`].
    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(|_| ())
    }

    /// Rank `root`'s `bytes` on every rank (the others' `bytes` are ignored).
    ///
    /// # Errors
    /// As [`Group::all_gather`]; [`Error::Invalid`] for a root outside the group.
    fn broadcast(&self, root: u32, bytes: &[u8]) -> Result<Vec<u8>> {
        if root >= self.world_size() {
            return Err(Error::Invalid(format!(
                "broadcast from rank {root} of {}",
                self.world_size()
            )));
        }
        let mine: &[u8] = if self.rank() == root { bytes } else { &[] };
        let mut all = self.all_gather(mine)?;
        Ok(std::mem::take(&mut all[root as usize]))
    }
}

/// What one rank's step of a collective creation gave: `Ok(payload)` or the cause.
pub type StepResult = std::result::Result<Vec<u8>, String>;

/// One all-or-nothing step: every rank contributes its step's result, and every rank
/// gets every payload (rank order) or, when any rank failed, the same
/// [`Error::RankFailed`] naming the lowest failed rank and its cause.
///
/// # Errors
/// [`Error::RankFailed`]; as [`Group::all_gather`].
pub fn all_or_nothing(group: &dyn Group, what: &str, mine: StepResult) -> Result<Vec<Vec<u8>>> {
    let mut msg = Vec::new();
    match &mine {
        Ok(p) => {
            msg.push(0u8);
            msg.extend_from_slice(p);
        }
        Err(e) => {
            msg.push(1u8);
            msg.extend_from_slice(e.as_bytes());
        }
    }
    let all = group.all_gather(&msg)?;
    let mut out = Vec::with_capacity(all.len());
    for (r, m) in all.into_iter().enumerate() {
        match m.split_first() {
            Some((0, p)) => out.push(p.to_vec()),
            Some((_, cause)) => {
                return Err(Error::RankFailed {
                    rank: r as u32,
                    step: what.to_string(),
                    cause: String::from_utf8_lossy(cause).into_owned(),
                })
            }
            None => {
                return Err(Error::Group(format!(
                    "{what}: rank {r} sent an empty status"
                )))
            }
        }
    }
    Ok(out)
}

/// What a rank asks for in the agreement step of a collective workspace creation
/// ([`vote`]): W, H, dtype and bytes per rank, as text (so that a disagreement reads
/// as what each rank asked for).
pub fn request_key(ws: &arfuse_policy::Workspace, layout: &arfuse_policy::ArfuseLayout) -> String {
    format!(
        "W = {}, H = {}, {}, {} bytes per rank",
        ws.world_size, ws.hidden, ws.dtype, layout.bytes_per_rank
    )
}

/// The agreement step of every collective workspace creation (collective): every rank
/// sends its request (`key`, [`request_key`]) and which backends its device can run
/// (`runs`); ranks that ask for different workspaces fail alike, and the backend is the
/// first of `chain` that every rank can run (the weakest rank wins), so that no rank
/// falls back alone.
///
/// # Errors
/// [`Error::Invalid`] naming two requests that differ; [`Error::NoBackend`] naming, per
/// backend of the chain, the ranks that cannot run it; as [`all_or_nothing`].
pub fn vote(
    group: &dyn Group,
    key: &str,
    chain: &[Backend],
    runs: &dyn Fn(Backend) -> bool,
) -> Result<Backend> {
    let mut mine = vec![
        u8::from(runs(Backend::Trtllm)),
        u8::from(runs(Backend::Mnnvl)),
    ];
    mine.extend_from_slice(key.as_bytes());
    let all = all_or_nothing(group, "backend vote", Ok(mine))?;
    let asked =
        |q: usize| String::from_utf8_lossy(all[q].get(2..).unwrap_or_default()).into_owned();
    if let Some(q) = (0..all.len()).find(|&q| asked(q) != key) {
        return Err(Error::Invalid(format!(
            "the ranks ask for different workspaces: rank 0 for {}, rank {q} for {}",
            asked(0),
            asked(q)
        )));
    }
    let can = |q: usize, b: Backend| {
        let i = match b {
            Backend::Trtllm => 0,
            Backend::Mnnvl => 1,
        };
        all[q].get(i) == Some(&1)
    };
    if let Some(&b) = chain.iter().find(|&&b| (0..all.len()).all(|q| can(q, b))) {
        return Ok(b);
    }
    let why: Vec<String> = chain
        .iter()
        .map(|&b| {
            let missing: Vec<String> = (0..all.len())
                .filter(|&q| !can(q, b))
                .map(|q| q.to_string())
                .collect();
            format!("{b}: not on rank(s) {}", missing.join(", "))
        })
        .collect();
    Err(Error::NoBackend(format!(
        "no backend of the chain runs on every rank ({})",
        why.join("; ")
    )))
}

/// The outcome of real-rank call `call` of `rank`, from its error word `word` and the
/// abort word of its state block `abort` (`arfuse_abi::protocol`): `Ok` when both are
/// clear. A peer's abort fails the call here too, even when this rank's CTAs had every
/// value they needed (the call failed on that rank, and the workspace is reset on every
/// rank); this rank's own abort, which its other CTAs read as a peer's, is not
/// reported as a peer's.
///
/// # Errors
/// [`Error::CallFailed`] naming this rank, the call, the error bits in words and, when
/// a peer aborted, that peer and its cause.
pub fn call_result(rank: u32, call: u64, word: u32, abort: u32) -> Result<()> {
    use arfuse_abi::protocol::{abort_word_parts, describe_error_word, ERR_PEER_ABORT};
    let mut word = word;
    let peer = match abort_word_parts(abort) {
        Some((r, code)) if r != rank => {
            word |= ERR_PEER_ABORT;
            format!("; rank {r} gave up first: {}", describe_error_word(code))
        }
        Some(_) if word & !ERR_PEER_ABORT != 0 => {
            word &= !ERR_PEER_ABORT;
            String::new()
        }
        _ => String::new(),
    };
    if word == 0 {
        return Ok(());
    }
    Err(Error::CallFailed {
        rank,
        call,
        word,
        what: describe_error_word(word),
        peer,
    })
}

/// A [`Group`] of W processes on this machine over a Unix socket: rank 0 listens at a
/// path and every other rank connects to it; an all-gather sends each rank's bytes to
/// rank 0, which sends every rank all of them. For Rust programs and tests; an engine
/// passes its own process group instead.
pub struct SocketGroup {
    rank: u32,
    world: u32,
    /// Rank 0: the stream of every other rank (index r - 1); others: the stream to rank 0.
    streams: Vec<UnixStream>,
}

fn group_err(what: &str, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => Error::Group(format!(
            "{what}: the peer is gone (its connection closed: {e})"
        )),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            Error::Group(format!("{what}: no answer within the group's timeout"))
        }
        _ => Error::Group(format!("{what}: {e}")),
    }
}

impl SocketGroup {
    /// Joins the group of `world` ranks as `rank`, meeting at the socket `path` (rank 0
    /// creates it; it must not exist). Every operation, joining included, gives up after
    /// `timeout`.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a rank outside `0..world`; [`Error::Group`] when the socket
    /// cannot be made or joined in time, or a peer answers with another world size.
    pub fn join(path: &Path, rank: u32, world: u32, timeout: Duration) -> Result<SocketGroup> {
        if world == 0 || rank >= world {
            return Err(Error::Invalid(format!("rank {rank} of a group of {world}")));
        }
        let deadline = Instant::now() + timeout;
        let mut streams = Vec::new();
        if rank == 0 {
            let listener = UnixListener::bind(path)
                .map_err(|e| group_err(&format!("binding {}", path.display()), e))?;
            listener
                .set_nonblocking(true)
                .map_err(|e| group_err("listener", e))?;
            let mut by_rank: Vec<Option<UnixStream>> = (1..world).map(|_| None).collect();
            let mut joined = 0;
            while joined + 1 < world {
                match listener.accept() {
                    Ok((s, _)) => {
                        s.set_nonblocking(false)
                            .map_err(|e| group_err("accept", e))?;
                        Self::bound(&s, timeout)?;
                        let mut s = s;
                        let mut hello = [0u8; 8];
                        s.read_exact(&mut hello)
                            .map_err(|e| group_err("hello", e))?;
                        let r = u32::from_le_bytes([hello[0], hello[1], hello[2], hello[3]]);
                        let w = u32::from_le_bytes([hello[4], hello[5], hello[6], hello[7]]);
                        if w != world || r == 0 || r >= world || by_rank[r as usize - 1].is_some() {
                            return Err(Error::Group(format!(
                                "a peer joined as rank {r} of {w}; this group has {world} ranks"
                            )));
                        }
                        by_rank[r as usize - 1] = Some(s);
                        joined += 1;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() > deadline {
                            return Err(Error::Group(format!(
                                "{} of {} ranks joined within {timeout:?}",
                                joined + 1,
                                world
                            )));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(group_err("accept", e)),
                }
            }
            streams.extend(by_rank.into_iter().flatten());
        } else {
            let mut s = loop {
                match UnixStream::connect(path) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() > deadline => {
                        return Err(group_err(&format!("joining {}", path.display()), e))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            };
            Self::bound(&s, timeout)?;
            let mut hello = rank.to_le_bytes().to_vec();
            hello.extend_from_slice(&world.to_le_bytes());
            s.write_all(&hello).map_err(|e| group_err("hello", e))?;
            streams.push(s);
        }
        Ok(SocketGroup {
            rank,
            world,
            streams,
        })
    }

    fn bound(s: &UnixStream, timeout: Duration) -> Result<()> {
        s.set_read_timeout(Some(timeout))
            .and_then(|()| s.set_write_timeout(Some(timeout)))
            .map_err(|e| group_err("socket timeout", e))
    }
}

fn send_frame(mut s: &UnixStream, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(&(bytes.len() as u64).to_le_bytes())?;
    s.write_all(bytes)
}

fn recv_frame(mut s: &UnixStream, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let n = u64::from_le_bytes(len);
    if n > limit as u64 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {n} bytes (limit {limit})"),
        ));
    }
    let mut buf = vec![0u8; n as usize];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

impl Group for SocketGroup {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.world
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        if mine.len() > MAX_GATHER_BYTES {
            return Err(Error::Group(format!(
                "all-gather of {} bytes (limit {MAX_GATHER_BYTES})",
                mine.len()
            )));
        }
        let limit = MAX_GATHER_BYTES;
        if self.rank == 0 {
            let mut all = vec![mine.to_vec()];
            for (i, s) in self.streams.iter().enumerate() {
                let part = recv_frame(s, limit)
                    .map_err(|e| group_err(&format!("all-gather: rank {}", i + 1), e))?;
                all.push(part);
            }
            let mut packed = Vec::new();
            for part in &all {
                packed.extend_from_slice(&(part.len() as u64).to_le_bytes());
                packed.extend_from_slice(part);
            }
            for (i, s) in self.streams.iter().enumerate() {
                send_frame(s, &packed)
                    .map_err(|e| group_err(&format!("all-gather: rank {}", i + 1), e))?;
            }
            Ok(all)
        } else {
            let s = &self.streams[0];
            send_frame(s, mine).map_err(|e| group_err("all-gather: rank 0", e))?;
            let packed = recv_frame(s, limit.saturating_mul(self.world as usize + 1))
                .map_err(|e| group_err("all-gather: rank 0", e))?;
            let mut all = Vec::with_capacity(self.world as usize);
            let mut rest = packed.as_slice();
            for _ in 0..self.world {
                let (len, tail) = rest
                    .split_first_chunk::<8>()
                    .ok_or_else(|| Error::Group("all-gather: a short answer from rank 0".into()))?;
                let n = usize::try_from(u64::from_le_bytes(*len))
                    .ok()
                    .filter(|&n| n <= tail.len())
                    .ok_or_else(|| Error::Group("all-gather: a bad answer from rank 0".into()))?;
                all.push(tail[..n].to_vec());
                rest = &tail[n..];
            }
            Ok(all)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(world: u32, dir: &Path) -> Vec<SocketGroup> {
        let path = dir.join("g.sock");
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let path = path.clone();
                    s.spawn(move || SocketGroup::join(&path, r, world, Duration::from_secs(10)))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        })
    }

    #[test]
    fn all_gather_barrier_broadcast_and_all_or_nothing() {
        let dir = std::env::temp_dir().join(format!("arfuse-group-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let gs = groups(3, &dir);
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = gs
                .iter()
                .map(|g| {
                    s.spawn(move || {
                        let all = g.all_gather(&[g.rank() as u8; 3]).unwrap();
                        g.barrier().unwrap();
                        let b = g.broadcast(2, b"from two").unwrap();
                        let step = if g.rank() == 1 {
                            Err("no memory".to_string())
                        } else {
                            Ok(vec![])
                        };
                        let e = all_or_nothing(g, "allocation", step).unwrap_err();
                        (all, b, e.to_string())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (all, b, e) in out {
            assert_eq!(all, vec![vec![0; 3], vec![1; 3], vec![2; 3]]);
            assert_eq!(b, b"from two");
            assert_eq!(e, "rank 1 failed in allocation: no memory");
        }
        drop(gs);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn call_results_name_the_rank_that_gave_up() {
        use arfuse_abi::protocol::{
            abort_word, ERR_CALL_MISMATCH, ERR_ONESHOT_TIMEOUT, ERR_PEER_ABORT,
        };
        assert!(call_result(1, 4, 0, 0).is_ok());
        // A peer's abort fails a call whose own word is clear.
        let e = call_result(1, 4, 0, abort_word(ERR_CALL_MISMATCH, 0)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "fused call 4 failed on rank 1: a peer aborted the call (error word 0x8); rank 0 \
             gave up first: ranks disagree on the call (T, call tag or sequence)"
        );
        // This rank's own abort is not a peer's.
        let e = call_result(
            2,
            0,
            ERR_ONESHOT_TIMEOUT | ERR_PEER_ABORT,
            abort_word(ERR_ONESHOT_TIMEOUT, 2),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "fused call 0 failed on rank 2: one-shot timeout waiting for a peer (error word 0x1)"
        );
    }

    #[test]
    fn a_missing_or_dead_peer_ends_in_an_error() {
        let dir = std::env::temp_dir().join(format!("arfuse-group-dead-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = SocketGroup::join(&dir.join("none.sock"), 0, 2, Duration::from_millis(200))
            .err()
            .unwrap();
        assert!(e.to_string().contains("1 of 2 ranks joined"), "{e}");
        let sub = dir.join("x");
        std::fs::create_dir_all(&sub).unwrap();
        let mut gs = groups(2, &sub);
        let g1 = gs.pop().unwrap();
        drop(g1);
        let e = gs[0].all_gather(b"x").unwrap_err();
        assert!(e.to_string().contains("all-gather: rank 1"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
