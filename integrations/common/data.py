"""Training data: synthetic tokens or a byte-level tokenized text sample (shipped in data/).

Both sources are pure functions of (seed, step, micro-batch index, data-parallel rank), so a resumed run sees
exactly the batches an uninterrupted run would have seen, with no iterator state in the checkpoint.

This is a simple dataset, not Megatron-Core's GPTDataset: GPTDataset needs the compiled ``helpers`` extension
and .bin/.idx files from Megatron's preprocessing tool; for a few-hundred-KB sample a random window over one
token array gives the same training signal with nothing to build.
"""

from __future__ import annotations

import gzip

import numpy as np
import torch

BYTE_VOCAB = 256


def byte_tokenize(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids 0..255 (the shipped tokenizer: no vocabulary file, no download)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def load_tokens(path: str) -> np.ndarray:
    """Token array from a .npy (scripts/tokenize_sample.py), or a .txt / .txt.gz tokenized on the fly."""
    if path.endswith(".npy"):
        return np.load(path).astype(np.int32)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return byte_tokenize(f.read())


class TokenBatches:
    """``batch(step, microbatch, dp_rank) -> LongTensor[micro_batch_size, seq_length + 1]``."""

    def __init__(self, kind: str, seq_length: int, micro_batch_size: int, vocab_size: int, seed: int, path):
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.vocab_size = vocab_size
        self.seed = seed
        self.tokens = None
        if kind == "text":
            tokens = load_tokens(path)
            if tokens.max() >= vocab_size:
                raise ValueError(
                    f"data.path={path!r}: token id {tokens.max()} >= model.vocab_size={vocab_size}"
                )
            if len(tokens) <= seq_length + 1:
                raise ValueError(f"data.path={path!r} has {len(tokens)} tokens; need more than seq_length+1")
            self.tokens = torch.from_numpy(tokens).long()

    def batch(self, step: int, microbatch: int, dp_rank: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((self.seed, step, microbatch, dp_rank)) % (2**62))
        shape = (self.micro_batch_size, self.seq_length + 1)
        if self.tokens is None:
            return torch.randint(0, self.vocab_size, shape, generator=gen)
        starts = torch.randint(0, len(self.tokens) - shape[1], (shape[0],), generator=gen)
        return torch.stack([self.tokens[s : s + shape[1]] for s in starts.tolist()])
