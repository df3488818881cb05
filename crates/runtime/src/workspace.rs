//! Workspace creation with the backend fallback chain `mnnvl -> trtllm -> unfused`,
//! failures cached per key (never retried), and a capture guard: while a stream
//! captures, nothing is created, allocated or retried (a retry during capture
//! invalidated a CUDA graph in public code; domain.md section 3).
//!
//! Device-independent: the actual creation is behind [`WorkspaceFactory`], so the
//! logic is unit-tested on the CPU with a fake device; every [`crate::device::Device`]
//! is one (its `create_workspace` and `is_capturing`).

use crate::error::{Error, Result};
use arfuse_policy::Workspace as WorkspaceRequest;
use std::collections::HashMap;

/// Where the fused kernel's peer buffers live: the ABI's one definition (mnnvl:
/// NVLink multicast buffers, needs multicast on every rank; trtllm: CUDA IPC peer
/// buffers inside one node, or virtual ranks on one GPU).
pub use arfuse_abi::Backend;

/// One step of a fallback chain: a fused backend, or `None` for the unfused path
/// (NCCL-style all-reduce + local kernels, no workspace).
pub type Fallback = Option<Backend>;

/// The default fallback chain.
pub const FALLBACK_CHAIN: [Fallback; 3] = [Some(Backend::Mnnvl), Some(Backend::Trtllm), None];

/// Creates workspaces on some device (a real GPU, or a fake in tests).
pub trait WorkspaceFactory {
    /// The created workspace.
    type Workspace;
    /// Whether any stream of this device is capturing a graph right now.
    fn is_capturing(&self) -> Result<bool>;
    /// Creates the workspace `request` (the plan's, per rank) mapped for `backend`.
    fn create(&mut self, backend: Backend, request: &WorkspaceRequest) -> Result<Self::Workspace>;
}

impl<D: crate::device::Device> WorkspaceFactory for D {
    type Workspace = D::Workspace;
    fn is_capturing(&self) -> Result<bool> {
        crate::device::Device::is_capturing(self)
    }
    fn create(&mut self, backend: Backend, request: &WorkspaceRequest) -> Result<D::Workspace> {
        self.create_workspace(backend, request)
    }
}

/// Outcome of [`WorkspaceManager::acquire`].
#[derive(Debug)]
pub enum Acquired<'a, W> {
    /// A fused backend with its workspace.
    Fused {
        /// Backend used.
        backend: Backend,
        /// The workspace (created now or earlier).
        workspace: &'a W,
    },
    /// Every fused backend failed or was skipped; run unfused. `reasons` says why,
    /// one entry per backend tried.
    Unfused {
        /// Why each fused backend was not used.
        reasons: Vec<String>,
    },
}

/// Creates and caches workspaces, remembering failures.
pub struct WorkspaceManager<F: WorkspaceFactory> {
    factory: F,
    live: HashMap<WorkspaceRequest, (Backend, F::Workspace)>,
    failures: HashMap<(Backend, WorkspaceRequest), String>,
    attempts: usize,
}

impl<F: WorkspaceFactory> WorkspaceManager<F> {
    /// A manager over `factory`.
    pub fn new(factory: F) -> Self {
        WorkspaceManager {
            factory,
            live: HashMap::new(),
            failures: HashMap::new(),
            attempts: 0,
        }
    }

    /// The factory (e.g. to launch on the device it wraps).
    pub fn factory(&self) -> &F {
        &self.factory
    }

    /// The factory, mutably (e.g. to allocate on the device it wraps).
    pub fn factory_mut(&mut self) -> &mut F {
        &mut self.factory
    }

    /// How many workspaces exist.
    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// How many times the factory's `create` was called (for tests and reports).
    pub fn attempts(&self) -> usize {
        self.attempts
    }

    /// The factory and, when one exists, the live workspace for `request` with its
    /// backend: both at once, so a caller can launch on the device the factory wraps
    /// with a workspace it holds. Never creates anything.
    pub fn parts(
        &mut self,
        request: &WorkspaceRequest,
    ) -> (&mut F, Option<(Backend, &F::Workspace)>) {
        let live = self.live.get(request).map(|(b, w)| (*b, w));
        (&mut self.factory, live)
    }

    /// The live workspace for `request`, if one was created.
    pub fn live(&self, request: &WorkspaceRequest) -> Option<&F::Workspace> {
        self.live.get(request).map(|(_, w)| w)
    }

    /// The factory and every live workspace with its request (in no particular order).
    /// Never creates anything.
    pub fn all_parts(&mut self) -> (&mut F, Vec<(&WorkspaceRequest, &F::Workspace)>) {
        let live = self.live.iter().map(|(r, (_, w))| (r, w)).collect();
        (&mut self.factory, live)
    }

    /// The cached failure of `backend` for `request`, if any.
    pub fn failure(&self, backend: Backend, request: &WorkspaceRequest) -> Option<&str> {
        self.failures
            .get(&(backend, request.clone()))
            .map(String::as_str)
    }

    /// Returns the workspace for `request`, creating it with the first backend of
    /// `chain` that works. An existing workspace is returned without any device call
    /// (also during capture). Failed backends are cached and skipped later.
    ///
    /// # Errors
    /// [`Error::Capturing`] when a workspace would have to be created while a stream
    /// captures; [`Error::NoBackend`] when the chain has no unfused (`None`) entry and
    /// every fused backend failed.
    pub fn acquire(
        &mut self,
        request: WorkspaceRequest,
        chain: &[Fallback],
    ) -> Result<Acquired<'_, F::Workspace>> {
        if self.live.contains_key(&request) {
            let (backend, ws) = &self.live[&request];
            return Ok(Acquired::Fused {
                backend: *backend,
                workspace: ws,
            });
        }
        let mut reasons = Vec::new();
        let mut capture_checked = false;
        for &step in chain {
            let Some(backend) = step else {
                return Ok(Acquired::Unfused { reasons });
            };
            if let Some(why) = self.failures.get(&(backend, request.clone())) {
                reasons.push(format!(
                    "{}: failed earlier (not retried): {why}",
                    backend.name()
                ));
                continue;
            }
            if !capture_checked {
                if self.factory.is_capturing()? {
                    return Err(Error::Capturing(format!(
                        "workspace ({request}) does not exist yet; create it before capture"
                    )));
                }
                capture_checked = true;
            }
            self.attempts += 1;
            match self.factory.create(backend, &request) {
                Ok(ws) => {
                    self.live.insert(request.clone(), (backend, ws));
                    let (b, ws) = &self.live[&request];
                    return Ok(Acquired::Fused {
                        backend: *b,
                        workspace: ws,
                    });
                }
                Err(e) => {
                    let why = e.to_string();
                    reasons.push(format!("{}: {why}", backend.name()));
                    self.failures.insert((backend, request.clone()), why);
                }
            }
        }
        Err(Error::NoBackend(reasons.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    struct Fake {
        capturing: Cell<bool>,
        mnnvl_ok: bool,
        trtllm_ok: bool,
        created: Vec<Backend>,
    }

    impl WorkspaceFactory for Fake {
        type Workspace = Backend;
        fn is_capturing(&self) -> Result<bool> {
            Ok(self.capturing.get())
        }
        fn create(&mut self, backend: Backend, _: &WorkspaceRequest) -> Result<Backend> {
            self.created.push(backend);
            let ok = match backend {
                Backend::Mnnvl => self.mnnvl_ok,
                Backend::Trtllm => self.trtllm_ok,
            };
            if ok {
                Ok(backend)
            } else {
                Err(Error::Unsupported(format!(
                    "{} not available",
                    backend.name()
                )))
            }
        }
    }

    fn fake(mnnvl_ok: bool, trtllm_ok: bool) -> Fake {
        Fake {
            capturing: Cell::new(false),
            mnnvl_ok,
            trtllm_ok,
            created: Vec::new(),
        }
    }

    fn req(h: u64) -> WorkspaceRequest {
        WorkspaceRequest::arfuse(
            arfuse_policy::Backend::Mnnvl,
            8,
            h,
            arfuse_policy::ActDtype::Bf16,
            Some(42),
            1_179_648,
        )
        .unwrap()
    }

    #[test]
    fn falls_back_and_caches_failures() {
        let mut m = WorkspaceManager::new(fake(false, true));
        match m.acquire(req(6144), &FALLBACK_CHAIN).unwrap() {
            Acquired::Fused { backend, workspace } => {
                assert_eq!(backend, Backend::Trtllm);
                assert_eq!(*workspace, Backend::Trtllm);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(m.factory().created, vec![Backend::Mnnvl, Backend::Trtllm]);
        assert!(m
            .failure(Backend::Mnnvl, &req(6144))
            .unwrap()
            .contains("mnnvl not available"));
        // Same key again: no device call at all.
        m.acquire(req(6144), &FALLBACK_CHAIN).unwrap();
        assert_eq!(m.attempts(), 2);
        // A new key tries mnnvl once more (failures are per key), then trtllm.
        m.acquire(req(4096), &FALLBACK_CHAIN).unwrap();
        assert_eq!(m.attempts(), 4);
    }

    #[test]
    fn all_fused_fail_gives_unfused_with_reasons_and_no_retry() {
        let mut m = WorkspaceManager::new(fake(false, false));
        match m.acquire(req(6144), &FALLBACK_CHAIN).unwrap() {
            Acquired::Unfused { reasons } => {
                assert_eq!(reasons.len(), 2);
                assert!(reasons[0].starts_with("mnnvl:") && reasons[1].starts_with("trtllm:"));
            }
            other => panic!("{other:?}"),
        }
        match m.acquire(req(6144), &FALLBACK_CHAIN).unwrap() {
            Acquired::Unfused { reasons } => {
                assert!(reasons.iter().all(|r| r.contains("not retried")))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(m.attempts(), 2, "failures must never be retried");
        let err = m
            .acquire(req(6144), &[Some(Backend::Mnnvl), Some(Backend::Trtllm)])
            .unwrap_err();
        assert!(matches!(err, Error::NoBackend(_)));
    }

    #[test]
    fn capture_refuses_creation_but_serves_existing() {
        let mut m = WorkspaceManager::new(fake(true, true));
        m.acquire(req(6144), &FALLBACK_CHAIN).unwrap();
        m.factory.capturing.set(true);
        // Existing workspace: fine during capture.
        assert!(matches!(
            m.acquire(req(6144), &FALLBACK_CHAIN).unwrap(),
            Acquired::Fused {
                backend: Backend::Mnnvl,
                ..
            }
        ));
        // New one: refused, nothing attempted, nothing cached as a failure.
        let err = m.acquire(req(4096), &FALLBACK_CHAIN).unwrap_err();
        assert!(matches!(err, Error::Capturing(_)), "{err}");
        assert_eq!(m.attempts(), 1);
        assert!(m.failure(Backend::Mnnvl, &req(4096)).is_none());
        m.factory.capturing.set(false);
        m.acquire(req(4096), &FALLBACK_CHAIN).unwrap();
        assert_eq!(m.attempts(), 2);
    }
}
