"""Build a larger local text corpus for convergence runs from the Python standard library's sources.

    python scripts/build_corpus.py /tmp/corpus.txt            # 24 MB, UTF-8
    python benchmark/e2e/compare.py recipe=deepseek_moe_fp8 parity=true \
        data.kind=text data.path=/tmp/corpus.txt

Why: the shipped data/sample.txt is 120 KB, about 4 optimizer steps of the deepseek recipes (8 x 4096
tokens per step), so a 500-step run memorizes it (loss -> 0.01) and a relative final-loss gap between FP8
and bf16 measures noise. The machines have no network, so this concatenates the `.py` files of the running
interpreter's stdlib (sorted by path, so the same Python version gives the same bytes) until `--mb` MB.
Nothing is downloaded and nothing is committed; the printed sha256 identifies the corpus in a report.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import sys
import sysconfig
from pathlib import Path


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("output")
    parser.add_argument("--mb", type=float, default=24.0, help="stop after this many MB (default 24)")
    args = parser.parse_args()
    limit = int(args.mb * (1 << 20))
    digest, size, files = hashlib.sha256(), 0, 0
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    # a .gz name is written gzip-compressed: the data loader opens .gz paths with gzip (a plain file under
    # that name failed at start-up), and 20 MB of text compresses to ~5 MB for the device's carry limit
    opener = gzip.open if args.output.endswith(".gz") else open
    with opener(args.output, "wt", encoding="utf-8") as out:
        for path in stdlib_sources():
            text = path.read_text(encoding="utf-8", errors="replace")
            chunk = f"# file: {path.name}\n{text}\n"
            out.write(chunk)
            data = chunk.encode("utf-8")
            digest.update(data)
            size, files = size + len(data), files + 1
            if size >= limit:
                break
    if size < limit:
        print(f"build_corpus: only {size / 2**20:.1f} MB of stdlib .py (asked {args.mb})", file=sys.stderr)
    print(f"build_corpus: {files} files, {size} bytes, Python {sys.version.split()[0]}, "
          f"sha256 {digest.hexdigest()[:16]} -> {args.output}")  # fmt: skip


if __name__ == "__main__":
    main()
