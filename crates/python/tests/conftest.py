"""pytest set-up: the spawned ranks import gloo_worker from this directory, and inductor
writes its caches to a directory of this run (no stale entries from another build)."""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="arfuse-inductor-"))
