"""Writes the AOTInductor package that tests/cpp/test_aoti.cpp loads from LibTorch (CTest runs it
as that test's fixture; tests/test_aoti.py checks it from Python): `Statistics`, the op with its
statistics, exported with dynamic query and key lengths and compiled ahead of time for the CPU.

    python3 tests/cpp/make_aoti_package.py OUT.pt2

Exits with 77 (CTest's skip code for this fixture), removing OUT.pt2, where torch or torch_ext cannot
be imported: a C++ build without the Python package has nothing to export with. CTest puts the
source tree first on PYTHONPATH, so that it exports with this checkout's torch_ext (built in place).
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import torch

    import torch_ext
except ImportError as e:  # (only as a script: tests/test_aoti.py imports it with torch_ext present)
    if __name__ == "__main__":
        Path(sys.argv[-1]).unlink(missing_ok=True)  # no stale package for test_aoti.cpp to load
        print(f"make_aoti_package: torch or torch_ext is not importable ({e}): no package", file=sys.stderr)
        sys.exit(77)
    raise


class Statistics(torch.nn.Module):
    """Causal attention with grouped queries (4 query heads, 2 key/value heads) and the log-n
    scale, returning the output, lse, entropy and n_keys. test_aoti.cpp calls the op with these
    arguments through its C++ API and compares."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        out, stats = torch_ext.attention(q, k, v, is_causal=True, scale="logn", train_length=16, enable_gqa=True,
                                         return_stats=True)
        return out, stats.lse, stats.entropy, stats.n_keys


def inputs(lq: int, lk: int, device: str = "cpu", seed: int = 0) -> tuple:
    """Seeded float64 q (2, 4, lq, 16), k and v (2, 2, lk, 16)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, h, n, 16, dtype=torch.float64, generator=g).to(device)
                 for h, n in ((4, lq), (2, lk), (2, lk)))


def package(path: str, device: str = "cpu") -> str:
    """Statistics exported with dynamic Lq and Lk (traced at 9 and 12) and compiled into `path`."""
    lq, lk = torch.export.Dim("Lq", min=2, max=4096), torch.export.Dim("Lk", min=2, max=4096)
    exported = torch.export.export(Statistics(), inputs(9, 12, device), dynamic_shapes=({2: lq}, {2: lk}, {2: lk}))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return torch._inductor.aoti_compile_and_package(exported, package_path=path)


def main(path: str) -> None:
    print(package(path))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
