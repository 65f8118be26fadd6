"""Run a Megatron-Core script unchanged on the CPU: ``with_megatron_cpu.py SCRIPT ARGS...``
installs the test-only ``tests/megatron_cpu.py`` shim, then runs SCRIPT as ``__main__``
with ARGS (how the tests run docs/integrations/megatron.md's recipe as printed)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the CPU shim
import megatron_cpu  # noqa: F401  (before Megatron places anything)

if __name__ == "__main__":
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
