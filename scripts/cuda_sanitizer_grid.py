"""A reduced grid of CUDA calls for compute-sanitizer: every kernel family at head dims 64, 128, 256
and 96 (the tensor-core families' padded path), the sm80 backward's compact tiles (the shared
memory per block capped at 99 KB), the Hopper forward on a persistent grid of one block (which
then walks every tile: the hand-offs between its tiles), masks (a learned bias's gradient too) and
the features (window, softcap, sinks, dropout, split-KV), forward and backward; and the Hopper
backward under deterministic algorithms.

Each call's output and gradients are compared with the same call on the CPU (float32), so a run
under ``compute-sanitizer --tool memcheck|racecheck|synccheck`` checks values as well as memory,
races and barriers:

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/cuda_sanitizer_grid.py
    compute-sanitizer --tool racecheck python3 scripts/cuda_sanitizer_grid.py --passes sm90-persistent

Small shapes (200 rows: a partial tile in every family) keep a run short (under a minute per tool
at D = 64 and 128 alone, on an H200; the grid as it stands has not been timed).
--passes NAME... runs only the passes named (fallback, sm80, sm90, sm80-99KB, sm90-persistent,
sm90-deterministic, which runs under torch.use_deterministic_algorithms(True): a name selects that
pass alone, so that --passes sm90 repeats neither of the last two), and
--variants NAME... only the variants named (VARIANTS' names, and dropout), --head-dims D... only
those of each pass's head dims. Exits 1
on a mismatch, 0 when every call agrees; prints one line per pass.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch_ext  # noqa: E402

# The device under test: cuda, or cpu to check this script without a GPU (as tests/test_cuda.py).
DEVICE = os.environ.get("ENTROPY_ATTN_CUDA_TEST_DEVICE", "cuda")

# (name, keyword arguments, split-KV setting): the variants each family runs.
VARIANTS: list[tuple[str, dict, str]] = [
    ("causal", {"is_causal": True}, "off"),
    ("bool_mask", {"mask": "bool"}, "off"),
    ("additive_mask", {"mask": "additive"}, "off"),
    # Masks in storage that ends 1 byte (bool) or 2 bytes (bf16) into the 4-byte word of their last
    # entry, which the tensor-core forwards would copy whole (csrc/cuda/mask_words.cuh) were the
    # mask not copied first (csrc/attention_inputs.h: word_readable): memcheck reports such a read
    # when each tensor is its own exact cudaMalloc (PYTORCH_NO_CUDA_MEMORY_CACHING=1).
    ("bool_mask_tight", {"mask": "bool_tight"}, "off"),
    ("additive_mask_tight", {"mask": "additive_tight"}, "off"),
    # A learned bias: the additive mask requires grad (the tensor-core backwards' atomics into its
    # gradient; in the sm90 pass the Hopper family's own, the loss being the output's alone:
    # sm90/bwd_kernel.cuh, kLogitGrads).
    ("learned_bias", {"mask": "learned", "is_causal": True}, "off"),
    ("window_softcap", {"is_causal": True, "window_size": (64, 0), "softcap": 30.0}, "off"),
    ("sinks", {"is_causal": True, "sinks": "sinks"}, "off"),
    ("split_kv", {}, "4"),
]
# Dropout draws other masks on the CPU: it runs without a comparison (its values finite).
DROPOUT = {"is_causal": True, "dropout_p": 0.2}
# (name, ENTROPY_ATTN_CUDA_FAMILY, other environment, head dims): the passes over the variants.
PASSES: list[tuple[str, str, dict[str, str], tuple[int, ...]]] = [
    (family, family, {}, (64, 128, 256, 96)) for family in ("fallback", "sm80", "sm90")
] + [
    # The sm80 backward's compact tiles: the shared memory per block capped at 99 KB.
    ("sm80-99KB", "sm80", {"ENTROPY_ATTN_CUDA_SMEM_PER_BLOCK": "101376"}, (128,)),
    # The Hopper forward on a persistent grid of one block: it walks the 4 query tiles of a call
    # (2 heads x 2 tiles of 128 rows), through both slots of its next tile and every hand-off of
    # sm90/fwd_kernel.cuh's persistent loop.
    ("sm90-persistent", "sm90", {"ENTROPY_ATTN_CUDA_PERSISTENT": "1"}, (64, 128)),
    # The Hopper backward under torch.use_deterministic_algorithms(True): dq's partial sums in
    # turns (sm90/bwd_kernel.cuh: write_dq's bulk reductions, and in the masked kernels the turn
    # keeper's named barriers with the consumers' atomics), a learned bias's gradient at the call's
    # full shape (csrc/cuda/attention_cuda.cpp: run_backward).
    ("sm90-deterministic", "sm90", {}, (64, 128)),
]
# The passes that run under torch.use_deterministic_algorithms(True).
DETERMINISTIC_PASSES = {"sm90-deterministic"}


def run_call(device: str, dtype: torch.dtype, base: list[torch.Tensor], kw: dict,
             mask: torch.Tensor, sinks: torch.Tensor) -> list[torch.Tensor]:
    """Forward with statistics and backward of one call; the output, lse, entropy and grads (the
    mask's last where it requires grad)."""
    q, k, v, g = (t.to(device, dtype) for t in base)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    kw = dict(kw)
    if "mask" in kw:
        kind = kw.pop("mask")
        m = (mask if kind.startswith("bool") else torch.where(mask, 0.0, -1e4).to(dtype)).to(device)
        if kind.endswith("_tight"):
            # The entries one past the start of storage one entry longer than they are.
            m = torch.empty(m.numel() + 1, dtype=m.dtype, device=device)[1:].view_as(m).copy_(m)
        kw["attn_mask"] = m.requires_grad_(kind == "learned")
    if kw.get("sinks") == "sinks":
        kw["sinks"] = sinks.to(device)
    if kw.get("dropout_p"):
        kw["generator"] = torch.Generator(device).manual_seed(3)
    out, stats = torch_ext.attention(q, k, v, return_stats=True, **kw)
    out.backward(g)
    grads = [t.grad.float() for t in (q, k, v, kw.get("attn_mask")) if t is not None and t.requires_grad]
    return [out.float(), stats.lse.float(), stats.entropy.float(), *grads]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the grid on DEVICE for each pass (those --passes names); 1 if a call disagrees with
    the CPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", nargs="+", metavar="NAME", choices=[p[0] for p in PASSES],
                        help="only these passes: %(choices)s")
    parser.add_argument("--head-dims", nargs="+", type=int, metavar="D",
                        help="only these of each pass's head dims")
    parser.add_argument("--variants", nargs="+", metavar="NAME",
                        choices=[v[0] for v in VARIANTS] + ["dropout"],
                        help="only these variants: %(choices)s")
    args = parser.parse_args(argv)
    passes = [p for p in PASSES if not args.passes or p[0] in args.passes]
    variants = [v for v in VARIANTS if not args.variants or v[0] in args.variants]
    with_dropout = not args.variants or "dropout" in args.variants
    gen = torch.Generator().manual_seed(0)
    failures = 0
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    warn_only_before = torch.is_deterministic_algorithms_warn_only_enabled()
    for family, forced, env, dims in passes:
        os.environ["ENTROPY_ATTN_CUDA_FAMILY"] = forced
        os.environ.update(env)
        torch.use_deterministic_algorithms(family in DETERMINISTIC_PASSES or deterministic_before,
                                           warn_only=warn_only_before)
        dims = tuple(d for d in dims if not args.head_dims or d in args.head_dims)
        for d in dims:
            base = [torch.randn(1, 2, 200, d, generator=gen) for _ in range(4)]
            mask = torch.rand(200, 200, generator=gen) > 0.3
            mask[:, 0] = True
            sinks = torch.randn(2, generator=gen)
            for name, kw, split in variants:
                os.environ["ENTROPY_ATTN_SPLIT_KV"] = split
                got = run_call(DEVICE, torch.bfloat16, base, kw, mask, sinks)
                want = run_call("cpu", torch.float32, [t.bfloat16().float() for t in base], kw, mask, sinks)
                for i, (a, b) in enumerate(zip(got, want)):
                    err = (a.cpu() - b).abs().max().item()
                    if not err <= 0.05 * max(1.0, b.abs().max().item()):
                        print(f"{family} D={d} {name}: output {i} differs by {err:.3g}")
                        failures += 1
            os.environ["ENTROPY_ATTN_SPLIT_KV"] = "off"
            if with_dropout:
                dropout = run_call(DEVICE, torch.bfloat16, base, DROPOUT, mask, sinks)
                if not all(torch.isfinite(t).all() for t in dropout):
                    print(f"{family} D={d} dropout: non-finite values")
                    failures += 1
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        for key in env:
            del os.environ[key]
        print(f"{family}: {len(variants) + with_dropout} variants x D {', '.join(map(str, dims))} run")
    torch.use_deterministic_algorithms(deterministic_before, warn_only=warn_only_before)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
