"""Writes the CUDA translation units and dispatch tables listed by csrc/cuda/kernels.toml.

    python3 scripts/generate_kernels.py           # write csrc/cuda/<family>/instantiations/
    python3 scripts/generate_kernels.py --check   # exit 1 if a generated file is missing or stale

Stale files (a translation unit no longer listed) are removed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_list  # noqa: E402


def main() -> int:
    """Writes (or checks) the generated files."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the files are up to date")
    parser.add_argument("--root", type=Path, default=kernel_list.ROOT,
                        help="the tree whose csrc/cuda/<family>/instantiations/ to write or check (default: this one)")
    args = parser.parse_args()
    root = args.root.resolve()
    files = kernel_list.generated_files(root=root)
    folders = {path.parent for path in files}
    stale = [p for folder in folders if folder.exists() for p in folder.iterdir() if p not in files]
    wrong = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in wrong + stale:
            print(f"out of date: {p.relative_to(root)}")
        if wrong or stale:
            print("run: python3 scripts/generate_kernels.py")
        return 1 if wrong or stale else 0
    for p in stale:
        p.unlink()
    for p in wrong:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(files[p])
    print(f"{len(files)} generated files ({len(wrong)} written, {len(stale)} removed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
