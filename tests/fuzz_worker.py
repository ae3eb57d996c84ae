"""The process that runs fuzz cases (test_fuzz.py): one JSON case per stdin line, one JSON verdict
per stdout line. It runs apart from pytest so that a crash (a signal, an abort) in the extension is
seen by the driver as this process dying on a named case, not as the test run dying.

A case is a plain dict drawn by test_fuzz.py's strategies:

* ``kind == "valid"``: inputs that follow scaled_dot_product_attention's rules (any layout: strided,
  transposed, expanded, non-contiguous last dim, zero sizes; masks of every broadcastable shape;
  NaN/inf entries). The op must run, its output, statistics and gradients must match the float64
  reference (reference.py), and a non-finite entry must reach exactly the rows that see it.
* otherwise the case breaks one rule (``kind`` names it); the op must raise a clear exception: a
  ValueError, TypeError, NotImplementedError or RuntimeError naming what is wrong, never an
  internal assertion.

Verdicts: {"ok": true} or {"ok": false, "why": ...}.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from typing import Any, Dict, Optional, Tuple

import torch

import torch_ext
from conftest import GRAD_TOL, OUT_TOL, STAT_TOL
from reference import allowed_mask, reference_attention

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
CLEAR_ERRORS = (ValueError, TypeError, NotImplementedError, RuntimeError, IndexError)


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values as x (B, H, L, D) in another memory layout."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "transposed":  # stored as (B, L, H, D), as a projection's output
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":  # every third element of a larger buffer in every dim: large strides
        big = torch.zeros(*(3 * s + 1 for s in x.shape), dtype=x.dtype)
        view = big[::3, ::3, ::3, ::3][: x.shape[0], : x.shape[1], : x.shape[2], : x.shape[3]]
        view.copy_(x)
        return view
    if layout == "last_dim_stride2":
        big = torch.zeros(*x.shape[:3], 2 * x.shape[3], dtype=x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    if layout == "expanded":  # one batch entry and head broadcast with stride 0
        return x[:1, :1].expand_as(x) if x.numel() else x
    raise ValueError(layout)


def build_valid(c: Dict[str, Any]) -> Tuple[Tuple[torch.Tensor, ...], Optional[torch.Tensor], Dict[str, Any]]:
    gen = torch.Generator().manual_seed(c["seed"])
    dtype = DTYPES[c["dtype"]]
    B, Hkv, H, Lq, Lk, D, Dv = (c[n] for n in ("B", "Hkv", "H", "Lq", "Lk", "D", "Dv"))
    shapes = {"q": (B, H, Lq, D), "k": (B, Hkv, Lk, D), "v": (B, Hkv, Lk, Dv)}
    tensors = {
        name: (torch.randn(shape, generator=gen, dtype=torch.float64) * c["magnitude"]).to(dtype)
        for name, shape in shapes.items()
    }
    if c["bad"] is not None:
        name, frac, val = c["bad"]
        # An expanded operand shows only its first (batch, head) entry: the bad value goes there.
        target = tensors[name][:1, :1] if c["layout"][name] == "expanded" else tensors[name]
        flat = target.reshape(-1)  # a view: both are contiguous
        if flat.numel():
            flat[min(int(frac * flat.numel()), flat.numel() - 1)] = val
    q, k, v = (laid_out(tensors[n], c["layout"][n]) for n in ("q", "k", "v"))
    mask = None
    m = c["mask"]
    if m is not None:
        full = (B, H, Lq, Lk)
        shape = tuple(full[d] if keep else 1 for d, keep in enumerate(m["dims"]))[4 - m["ndim"]:]
        allow = torch.rand(shape, generator=gen) < m["density"]
        if m["kind"] == "bool":
            mask = allow
        else:
            mask = torch.where(allow, torch.randn(shape, generator=gen, dtype=torch.float64), -math.inf).to(dtype)
    kwargs = dict(is_causal=c["is_causal"], enable_gqa=H != Hkv, window_size=tuple(c["window"]))
    if c["scale"] is not None:
        kwargs["scale"] = c["scale"]
    if c["softcap"] is not None:
        kwargs["softcap"] = c["softcap"]
    if c["sinks"]:
        kwargs["sinks"] = torch.randn(H, generator=gen, dtype=torch.float64).to(dtype)
    return (q, k, v), mask, kwargs


def check_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tuple[float, float]) -> Optional[str]:
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        return f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    if not torch.allclose(a, e, atol=tol[0], rtol=tol[1]):
        err = (a - e).abs().nan_to_num(math.inf).max().item() if a.numel() else 0.0
        return f"{name}: max abs error {err:.3g} (atol {tol[0]}, rtol {tol[1]})"
    return None


def visibility(c: Dict[str, Any], mask: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, H, Lq, Lk) bool: row i sees key j."""
    return allowed_mask(c["B"], c["H"], c["Lq"], c["Lk"], mask, c["is_causal"], window_size=tuple(c["window"]))


def run_valid(c: Dict[str, Any]) -> Dict[str, Any]:
    (q, k, v), mask, kwargs = build_valid(c)
    dtype = q.dtype
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    try:
        out, st = torch_ext.attention(*leaves, mask, return_stats=True, **kwargs)
        gen = torch.Generator().manual_seed(c["seed"] + 1)
        w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        loss = (out.double() * w).sum() + st.lse.double().sum() + st.entropy.double().sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    except Exception as e:  # noqa: BLE001 (a valid case must run)
        return {"ok": False, "why": f"valid case raised {type(e).__name__}: {e}"}
    if out.dtype != dtype or out.shape != (c["B"], c["H"], c["Lq"], c["Dv"]):
        return {"ok": False, "why": f"output {out.dtype} {tuple(out.shape)}"}

    if c["bad"] is not None:
        return check_nonfinite(c, (q, k, v), mask, kwargs, out)

    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref = reference_attention(*ref_leaves, mask, **kwargs)
    ref_loss = (ref.output * w).sum() + ref.lse.sum() + ref.entropy.sum()
    ref_grads = torch.autograd.grad(ref_loss, ref_leaves, allow_unused=True)
    # The suite's tolerances are for unit-scale inputs; logits grow with the square of the inputs'
    # magnitude, and the rounding error of the weights with the logits.
    f = max(1.0, c["magnitude"]) ** 2
    out_tol, stat_tol = (tuple(f * t for t in tbl[dtype]) for tbl in (OUT_TOL, STAT_TOL))
    problems = [
        check_close("output", out, ref.output, out_tol),
        check_close("lse", st.lse, ref.lse, stat_tol),
        check_close("entropy", st.entropy, ref.entropy, stat_tol),
        check_close("effective_keys", st.effective_keys, ref.effective_keys, tuple(10 * t for t in stat_tol)),
    ]
    if not torch.equal(st.n_keys, ref.n_keys):
        problems.append("n_keys differ")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        g = torch.zeros_like(rg) if g is None else g.double()
        rg = torch.zeros_like(g) if rg is None else rg
        scale = max(float(rg.norm()), 1.0)
        if not torch.isfinite(g).all() or float((g - rg).norm()) > 4 * f * GRAD_TOL[dtype] * scale:
            problems.append(f"{name}: relative error {float((g - rg).norm()) / scale:.3g}")
    problems = [p for p in problems if p]
    return {"ok": not problems, "why": "; ".join(problems)}


def check_nonfinite(c, inputs, mask, kwargs, out) -> Dict[str, Any]:
    """A non-finite entry reaches exactly the outputs of the rows that see it; everything else is
    what the op gives with the entry replaced by 0 (up to rounding: the entry's finite neighbours
    in its key's row may be summed in another order)."""
    name, frac, val = c["bad"]
    q, k, v = inputs
    clean = [t.nan_to_num(0.0, 0.0, 0.0) for t in inputs]
    out0 = torch_ext.attention(*clean, mask, **kwargs)
    sees = visibility(c, mask)  # (B, H, Lq, Lk)
    G = c["H"] // c["Hkv"]
    # Which (b, h, i, d) outputs may be non-finite: rows that see a bad key / value column / query.
    bad = ~torch.isfinite({"q": q, "k": k, "v": v}[name].double())
    if name == "q":  # a row with no key gives 0 whatever its query
        hit = (bad.any(-1) & sees.any(-1)).unsqueeze(-1).expand(out.shape)
    elif name == "k":
        bad_key = bad.any(-1).repeat_interleave(G, dim=1)  # (B, H, Lk)
        hit = (sees & bad_key.unsqueeze(2)).any(-1, keepdim=True).expand(out.shape)
    else:
        bad_v = bad.repeat_interleave(G, dim=1).double()  # (B, H, Lk, Dv)
        hit = (sees.double() @ bad_v) > 0
    nonfinite = ~torch.isfinite(out.double())
    if (nonfinite & ~hit).any():
        where = (nonfinite & ~hit).nonzero()[0].tolist()
        return {"ok": False, "why": f"non-finite {name} entry reached output {where}, a row that does not see it"}
    atol, rtol = (max(1.0, c["magnitude"]) ** 2 * t for t in OUT_TOL[out.dtype])
    same = torch.isclose(out.double(), out0.double(), atol=atol, rtol=rtol) | hit
    if not same.all():
        where = (~same).nonzero()[0].tolist()
        return {"ok": False, "why": f"output {where} changed with a non-finite {name} entry it does not see"}
    if val != val and not nonfinite[hit].all():  # a NaN shows wherever it is seen
        return {"ok": False, "why": f"an output that sees the NaN {name} entry is finite"}
    return {"ok": True}


def run_invalid(c: Dict[str, Any]) -> Dict[str, Any]:
    gen = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(2, 2, 5, 8, generator=gen)
    k = torch.randn(2, 2, 6, 8, generator=gen)
    v = torch.randn(2, 2, 6, 8, generator=gen)
    args: list = [q, k, v, None]
    kw: Dict[str, Any] = {}
    what = c["kind"]
    if what == "query_type":
        args[0] = q.tolist()
    elif what == "key_type":
        args[1] = 3.0
    elif what == "value_type":
        args[2] = None
    elif what == "mask_type":
        args[3] = "causal"
    elif what == "mask_shape":
        args[3] = torch.ones(2, 2, 5, 7, dtype=torch.bool)
    elif what == "mask_dtype":
        args[3] = torch.ones(5, 6, dtype=torch.int64)
    elif what == "mixed_dtype":
        args[1] = k.double()
    elif what == "mixed_device":
        args[2] = v.to("meta")
    elif what == "head_dim":
        args[1] = torch.randn(2, 2, 6, 7, generator=gen)
    elif what == "gqa":
        args[0] = torch.randn(2, 3, 5, 8, generator=gen)  # 3 query heads over 2 kv heads
        kw["enable_gqa"] = True
    elif what == "rank":
        args[0] = q[0]
    elif what == "integer_input":
        args[0] = q.to(torch.int32)
    elif what == "scale_type":
        kw["scale"] = [0.1]
    elif what == "scale_value":
        kw["scale"] = "log"
    elif what == "temperature":
        kw["temperature"] = c["number"]
    elif what == "window":
        kw["window_size"] = (c["int"], "x")
    elif what == "softcap":
        kw["softcap"] = -abs(c["number"]) if c["number"] == c["number"] else c["number"]
    elif what == "dropout":
        kw["dropout_p"] = 1.5
    elif what == "sinks":
        kw["sinks"] = torch.zeros(5)
    elif what == "batch":
        args[1] = torch.randn(3, 2, 6, 8, generator=gen)
    else:
        return {"ok": False, "why": f"unknown invalid kind {what}"}
    try:
        torch_ext.attention(*args, **kw)
    except CLEAR_ERRORS as e:
        msg = str(e)
        if not msg or "INTERNAL ASSERT" in msg or "Expected" in msg and "to be true" in msg:
            return {"ok": False, "why": f"{what}: unclear {type(e).__name__}: {msg[:300]}"}
        return {"ok": True}
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "why": f"{what}: {type(e).__name__}: {e}"}
    return {"ok": False, "why": f"{what}: accepted"}


def main() -> None:
    torch.set_num_threads(1)
    for line in sys.stdin:
        case = json.loads(line)
        try:
            verdict = run_valid(case) if case["kind"] == "valid" else run_invalid(case)
        except Exception:  # noqa: BLE001 (a bug of the worker or the reference: report it)
            verdict = {"ok": False, "why": "worker error: " + traceback.format_exc(limit=4)}
        sys.stdout.write(json.dumps(verdict) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
