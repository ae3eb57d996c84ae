"""benchmarks/features.py's tables: milliseconds to three significant digits whatever their size
(CUDA times are fractions of a millisecond; one decimal printed them as 0.0 and 0.1), columns that a
run did not measure shown as a dash."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import features  # noqa: E402  (benchmarks/ is not a package)

RESULT = {
    "device": "NVIDIA H200", "torch": "2.11.0", "commit": "abc1234", "dtype": "bfloat16", "heads": 16,
    "head_dim": 64,
    "windows": [
        {"seq_len": 2048, "window": 1024, "ours_window_ms": 0.06634, "ours_causal_ms": 0.05874,
         "sdpa_causal_ms": 0.03786, "sdpa_window_mask_ms": 0.08378, "ours_window_mib": 4.625,
         "sdpa_window_mask_mib": 12.0},
        {"seq_len": 16384, "window": 1024, "ours_window_ms": 0.2708, "ours_causal_ms": 1.3796,
         "sdpa_causal_ms": 1.2657, "ours_window_mib": 37.0},
    ],
    "packed": {"docs": 8, "doc_len": 2048, "tokens": 16384, "ours_varlen_ms": 0.4294, "ours_varlen_mib": 74.0,
               "sdpa_loop_ms": 0.3083, "sdpa_loop_mib": 32.0, "sdpa_block_mask_ms": 2000.4,
               "sdpa_block_mask_mib": 544.0},
}


def test_markdown_keeps_three_significant_digits() -> None:
    text = features.markdown(RESULT)
    assert "| 2048 | 0.0663 | 0.0587 | 0.0379 | 0.0838 | 1.75 | 4.6 | 12.0 |" in text
    assert "| 16384 | 0.271 | 1.38 | 1.27 | — | 0.21 | 37.0 | — |" in text
    assert "| ours, varlen_attention | 0.429 | 74.0 |" in text
    assert "| SDPA, block-diagonal (T, T) mask | 2000 | 544.0 |" in text
    assert "torch varlen_attn" not in text  # not measured (the CPU run): no row
    assert "## Causal sliding window of W = 1024 keys" in text and "(T = 16384)" in text
