"""The same training as ``train.py`` with a deliberate, classic resume bug.

After ``restore()`` it builds a fresh AdamW: the restored moments are thrown away while
the LR schedule carries on. Real training stacks shipped this; nothing crashes, the loss
just drifts. ``unbroken resume-test`` must fail on it and the post-resume health check
must name the signature. Same arguments as ``train.py``.
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path

if __name__ == "__main__":
    os.environ["EXAMPLE_RESET_OPTIMIZER"] = "1"
    runpy.run_path(str(Path(__file__).with_name("train.py")), run_name="__main__")
