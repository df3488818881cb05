"""The FX serializer of the Python package `arfuse` (`crates/python/python/arfuse/fx_json.py`,
docs/fx-graph-format.md), loaded from the checkout by its path so that these scripts run
without the package installed. The one definition is the package's."""

from __future__ import annotations

import importlib.util
import os

_PATH = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..", "..", "crates", "python", "python", "arfuse", "fx_json.py",
)
_spec = importlib.util.spec_from_file_location("arfuse_fx_json", _PATH)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

FORMAT = _mod.FORMAT
FORMAT_VERSION = _mod.FORMAT_VERSION
parameter_fqn = _mod.parameter_fqn
serialize = _mod.serialize
