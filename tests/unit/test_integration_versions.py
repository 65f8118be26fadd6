"""The framework versions CI tests are the ones pyproject pins and the docs name.

The integrations rely on private hooks of each framework's resume path, which move
between releases: a page naming one version while CI installs another (transformers 5.23
in the docs, 5.24 installed) claims a test that never ran.
"""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# distribution -> the docs page that names the version it was tested with
PAGES = {
    "accelerate": "docs/integrations/accelerate.md",
    "lightning": "docs/integrations/lightning.md",
    "transformers": "docs/integrations/transformers.md",
    "megatron-core": "docs/integrations/megatron.md",
    "megatron-fsdp": "docs/integrations/megatron.md",
    "deepspeed": "docs/integrations/deepspeed.md",
}


def _pins() -> dict[str, str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    pins = {}
    for requirement in extras["dev"]:
        name, _, pinned = requirement.partition("==")
        if pinned:
            pins[name.strip()] = pinned.strip()
    return pins


@pytest.mark.parametrize("name", ["accelerate", "lightning", "transformers", "datasets",
                                  "tensorboard", "wandb", "torchdata", "megatron-core",
                                  "megatron-fsdp", "deepspeed"])  # fmt: skip
def test_ci_installs_exactly_the_pinned_version(name):
    pins = _pins()
    assert name in pins, f"pyproject's dev extra does not pin {name} exactly"
    assert version(name) == pins[name], (
        f"{name} {version(name)} is installed but pyproject pins {pins[name]}: run make install"
    )


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_docs_name_the_version_ci_tests(name):
    pinned = _pins()[name]
    page = (ROOT / PAGES[name]).read_text(encoding="utf-8")
    assert re.search(rf"\b{re.escape(pinned)}\b", page), f"{PAGES[name]} does not name {pinned}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(rf"\b{re.escape(pinned)}\b", readme), (
        f"README.md does not name {name} {pinned}"
    )
