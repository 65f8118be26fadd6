"""A learnable synthetic token corpus on disk, and next-token windows over it.

The corpus is a stream of "words" (fixed random spellings of 2-6 letters) separated by
a space token, the word sequence drawn from a sparse Markov chain: inside a word the
next letter is certain given its prefix, and after a word only a few words may follow.
A tiny GPT learns the spellings within a few dozen steps, so loss drops fast and far.
The file is generated from a fixed seed (never from the training seed), so every run
and every rank sees the same bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 64  # token 0 is the space between words, 1..63 are letters
BLOCK_SIZE = 32
NUM_TOKENS = 200_000  # 400 KB as uint16
FILE_NAME = "words-v1.npy"  # bump the version if the generator below ever changes

_SEED = 20240601
_NUM_WORDS = 32
_FOLLOWERS = 4  # how many different words may follow each word


def generate(num_tokens: int = NUM_TOKENS, seed: int = _SEED) -> np.ndarray:
    """The corpus as a uint16 array; the same for the same arguments, everywhere."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 7, size=_NUM_WORDS)
    words = [rng.integers(1, VOCAB_SIZE, size=n).tolist() for n in lengths]
    followers = rng.integers(0, _NUM_WORDS, size=(_NUM_WORDS, _FOLLOWERS))
    weights = rng.dirichlet(np.ones(_FOLLOWERS), size=_NUM_WORDS).cumsum(axis=1)
    # One uniform draw per word, taken up front: the Python loop below only indexes.
    draws = rng.random(num_tokens)
    out: list[int] = []
    word = 0
    i = 0
    while len(out) < num_tokens:
        out.extend(words[word])
        out.append(0)
        choice = min(int(np.searchsorted(weights[word], draws[i])), _FOLLOWERS - 1)
        word = int(followers[word, choice])
        i += 1
    return np.asarray(out[:num_tokens], dtype=np.uint16)


def prepare(data_dir: str | os.PathLike) -> Path:
    """Write the corpus into ``data_dir`` unless it is there already; return its path.

    Safe when several ranks call it at once: each writes a private temporary file and
    renames it into place atomically, and all of them write the same bytes.
    """
    path = Path(data_dir) / FILE_NAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, generate())
        os.replace(tmp, path)
    return path


class TokenWindows(Dataset):
    """Map-style dataset of (x, y) pairs: ``block_size`` tokens and the same shifted by one.

    Windows start every ``block_size`` tokens (they do not overlap). ``limit`` keeps only
    the first windows, to make short epochs.
    """

    def __init__(
        self, path: str | os.PathLike, block_size: int = BLOCK_SIZE, limit: int | None = None
    ) -> None:
        self.tokens = np.load(path)
        self.block_size = block_size
        count = (len(self.tokens) - 1) // block_size
        self.count = count if limit is None else min(limit, count)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} out of range [0, {self.count})")
        start = index * self.block_size
        chunk = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]
