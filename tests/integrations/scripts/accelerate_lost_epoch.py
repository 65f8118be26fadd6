"""examples/accelerate_train.py with the resume Accelerate's own loader state gives.

``DataLoaderShard.state_dict()`` holds the position within the epoch but not the epoch
counter (``iteration``), which seeds the shuffle of a ``SeedableRandomSampler``. Here the
integration restores the position and leaves the counter as a fresh loader has it, as
``accelerator.load_state`` does: a resume after the first epoch replays epoch 0's order.

    python accelerate_lost_epoch.py DIR [example arguments]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from unbroken.integrations import accelerate as integration

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "accelerate_train.py"
_restore = integration._PreparedLoader.load_state_dict


def _without_the_epoch(self, state):
    fresh = self._loader.iteration
    _restore(self, state)
    self._loader.iteration = fresh


integration._PreparedLoader.load_state_dict = _without_the_epoch
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
runpy.run_path(str(EXAMPLE), run_name="__main__")
