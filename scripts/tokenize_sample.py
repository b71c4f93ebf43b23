"""Tokenize a text file with the shipped byte-level tokenizer into a .npy token array (no downloads).

    python scripts/tokenize_sample.py                       # data/sample.txt -> data/sample_tokens.npy
    python scripts/tokenize_sample.py my.txt out.npy
    torchrun --nproc_per_node=2 train.py data.kind=text data.path=data/sample_tokens.npy

train.py also accepts the .txt directly (tokenized on the fly); the .npy form is for larger corpora.
Token ids are UTF-8 bytes 0..255, so any recipe with model.vocab_size >= 256 can train on it.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from primus_turbo.integrations.common.data import byte_tokenize

    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("input", nargs="?", default=os.path.join(REPO, "data", "sample.txt"))
    parser.add_argument("output", nargs="?", default=os.path.join(REPO, "data", "sample_tokens.npy"))
    args = parser.parse_args()
    with open(args.input, encoding="utf-8") as f:
        tokens = byte_tokenize(f.read()).astype(np.uint16)
    np.save(args.output, tokens)
    print(f"tokenize_sample: {len(tokens)} tokens (vocab 256) -> {args.output}")


if __name__ == "__main__":
    main()
