#!/usr/bin/env bash
# Installs the NVRTC wheel the runtime's CPU-side kernel checks need (NVRTC >= 12.8
# for sm_100a; the wheel also runs ptxas internally for sm_* targets, so register and
# spill figures come without nvcc). Idempotent and quiet; prints where NVRTC is.
# arfuse-runtime finds the wheel's libnvrtc by itself (it asks python3 for its
# site-packages), so no environment variable is needed; ARFUSE_NVRTC_PATH is printed
# for tools that want it.
set -euo pipefail
PY="${PYTHON:-python3}"
PKG="nvidia-cuda-nvrtc-cu12"   # 12.9.x: supports sm_90a and sm_100a
find_lib() {
  "$PY" - <<'PYEOF' 2>/dev/null
import glob, os, site, sys
paths = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for p in paths:
    for sub in ("nvidia/cuda_nvrtc/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"):
        for name in ("libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"):
            f = os.path.join(p, sub, name)
            if os.path.isfile(f):
                print(f)
                raise SystemExit(0)
raise SystemExit(1)
PYEOF
}
if ! lib="$(find_lib)"; then
  "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "$PKG>=12.8,<13" >/dev/null
  lib="$(find_lib)"
fi
echo "ARFUSE_NVRTC_PATH=$lib"
