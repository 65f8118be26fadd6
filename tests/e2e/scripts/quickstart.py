"""The README quickstart, run verbatim: the code block is read from README.md and executed
around a small model with dropout, AdamW with a schedule, a GradScaler and a shuffled
StatefulDataLoader over a learnable dataset. Usage: quickstart.py DIR [TOTAL_STEPS].

The only change to the quickstart's text: its folder "ckpts/run1" becomes DIR.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

README = Path(__file__).parents[3] / "README.md"


def quickstart_code() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quickstart") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def main() -> None:
    folder = sys.argv[1]
    total_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    torch.set_num_threads(1)
    torch.manual_seed(0)

    xs = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
    ys = (xs[:, :4].sin().sum(1) - xs[:, 4:].cos().sum(1)).unsqueeze(1)
    loader = StatefulDataLoader(list(zip(xs, ys, strict=True)), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)
    scaler = torch.amp.GradScaler("cpu")
    batches = iter(())

    def train_step():
        nonlocal batches
        try:
            x, y = next(batches)
        except StopIteration:  # an epoch ended: the next one, shuffled anew
            batches = iter(loader)
            x, y = next(batches)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        return loss.item(), grad_norm.item()

    code = quickstart_code()
    assert code.count('"ckpts/run1"') == 1, "the quickstart's folder changed: update this"
    exec(code.replace('"ckpts/run1"', repr(folder)), {**globals(), **locals()})


if __name__ == "__main__":
    main()
