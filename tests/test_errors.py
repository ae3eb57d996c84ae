"""Bad inputs raise ValueError / TypeError whose message names the offending argument."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
from torch import Tensor

import torch_ext
from conftest import DEVICES, HAS_CUDA, to_device

ERR = (ValueError, TypeError)
B, H, Lq, Lk, D = 2, 4, 5, 6, 8


def qkv(device: str = "cpu", **over: Any) -> Dict[str, Any]:
    """Valid keyword arguments for torch_ext.attention on `device`, with overrides (used as given)."""
    kw: Dict[str, Any] = dict(
        query=torch.randn(B, H, Lq, D, device=device),
        key=torch.randn(B, H, Lk, D, device=device),
        value=torch.randn(B, H, Lk, D, device=device),
    )
    kw.update(over)
    return kw


def call(device: str = "cpu", **over: Any) -> Any:
    """Call torch_ext.attention with valid defaults on `device` overridden by `over`."""
    kw = qkv(device, **over)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    mask = kw.pop("attn_mask", None)
    return torch_ext.attention(q, k, v, mask, **kw)


def test_valid_call_works() -> None:
    """Control: the defaults used by the error tests are valid."""
    out = call()
    assert out.shape == (B, H, Lq, D)
    call(key=torch.randn(B, 2, Lk, D), value=torch.randn(B, 2, Lk, D), enable_gqa=True)


# (id, overrides, argument name regex)
CASES: Tuple[Tuple[str, Dict[str, Any], str], ...] = (
    # ranks
    ("query_rank3", dict(query=torch.randn(H, Lq, D)), "query"),
    ("query_rank5", dict(query=torch.randn(1, B, H, Lq, D)), "query"),
    ("key_rank3", dict(key=torch.randn(H, Lk, D)), "key"),
    ("value_rank2", dict(value=torch.randn(Lk, D)), "value"),
    # mismatched dims
    ("key_batch", dict(key=torch.randn(B + 1, H, Lk, D)), "key"),
    ("value_batch", dict(value=torch.randn(B + 1, H, Lk, D)), "value"),
    ("key_head_dim", dict(key=torch.randn(B, H, Lk, D + 1)), "key"),
    ("value_len", dict(value=torch.randn(B, H, Lk + 1, D)), "value"),
    ("value_heads", dict(value=torch.randn(B, 2, Lk, D)), "value"),
    # GQA
    ("gqa_not_multiple", dict(key=torch.randn(B, 3, Lk, D), value=torch.randn(B, 3, Lk, D), enable_gqa=True), "key|query|enable_gqa"),
    ("gqa_more_kv_heads", dict(key=torch.randn(B, 8, Lk, D), value=torch.randn(B, 8, Lk, D), enable_gqa=True), "key|query|enable_gqa"),
    ("gqa_not_enabled", dict(key=torch.randn(B, 2, Lk, D), value=torch.randn(B, 2, Lk, D)), "enable_gqa"),
    # dtypes
    ("key_dtype_mixed", dict(key=torch.randn(B, H, Lk, D, dtype=torch.float64)), "key"),
    ("value_dtype_mixed", dict(value=torch.randn(B, H, Lk, D).bfloat16()), "value"),
    ("query_int", dict(query=torch.ones(B, H, Lq, D, dtype=torch.int64)), "query"),
    ("all_int", dict(query=torch.ones(B, H, Lq, D, dtype=torch.int32), key=torch.ones(B, H, Lk, D, dtype=torch.int32), value=torch.ones(B, H, Lk, D, dtype=torch.int32)), "query"),
    ("key_int", dict(key=torch.ones(B, H, Lk, D, dtype=torch.int64)), "key"),
    # masks
    ("mask_shape", dict(attn_mask=torch.ones(Lq, Lk + 1, dtype=torch.bool)), "attn_mask"),
    ("mask_shape_rows", dict(attn_mask=torch.ones(Lq + 2, Lk, dtype=torch.bool)), "attn_mask"),
    ("mask_shape_batch", dict(attn_mask=torch.ones(3, 1, Lq, Lk, dtype=torch.bool)), "attn_mask"),
    ("mask_rank5", dict(attn_mask=torch.ones(1, B, H, Lq, Lk, dtype=torch.bool)), "attn_mask"),
    ("mask_int", dict(attn_mask=torch.ones(Lq, Lk, dtype=torch.int64)), "attn_mask"),
    ("mask_uint8", dict(attn_mask=torch.ones(Lq, Lk, dtype=torch.uint8)), "attn_mask"),
    # scale
    ("scale_tensor_bad_shape", dict(scale=torch.ones(H + 1, 1)), "scale"),
    ("scale_tensor_bad_len", dict(scale=torch.ones(Lq + 1)), "scale"),
    ("scale_tensor_rank4", dict(scale=torch.ones(B, H, Lq, 1)), "scale"),
    ("scale_unknown_string", dict(scale="log"), "scale"),
    ("scale_unknown_string2", dict(scale="fixed_logn"), "scale"),
    ("scale_list", dict(scale=[0.5]), "scale"),
    ("scale_object", dict(scale=object()), "scale"),
    ("scale_complex", dict(scale=1j), "scale"),
    ("scale_tensor_int", dict(scale=torch.ones(H, 1, dtype=torch.int64)), "scale"),
    ("scale_factor_str", dict(scale="logn", scale_factor="a"), r"^scale_factor must be None, a float or a Tensor, got str$"),
    ("scale_factor_tensor_int", dict(scale="logn", scale_factor=torch.ones(H, 1, dtype=torch.int64)), "scale_factor"),
    # temperature
    ("temperature_zero", dict(temperature=0.0), "temperature"),
    ("temperature_negative", dict(temperature=-1.0), "temperature"),
    ("temperature_nan", dict(temperature=float("nan")), "temperature"),
    ("temperature_inf", dict(temperature=float("inf")), "temperature"),
    ("temperature_neg_inf", dict(temperature=float("-inf")), "temperature"),
    # train_length
    ("train_length_one_logn", dict(scale="logn", train_length=1), "train_length"),
    ("train_length_zero_sharpen", dict(scale="logn_sharpen", train_length=0), "train_length"),
    ("train_length_negative_logn", dict(scale="logn", train_length=-5), "train_length"),
    ("train_length_half_logn", dict(scale="logn", train_length=0.5), "train_length"),
    ("train_length_one_default_scale", dict(train_length=1), "train_length"),
    ("temperature_subnormal", dict(temperature=1e-310), "temperature"),  # 1 / tau overflows
    # flags and argument types: a TypeError, as SDPA's parser (truthiness read "False" as True)
    ("is_causal_str", dict(is_causal="False"), "is_causal"),
    ("enable_gqa_str", dict(enable_gqa="no"), "enable_gqa"),
    ("return_stats_str", dict(return_stats="no"), "return_stats"),
    ("is_causal_int", dict(is_causal=1), "is_causal"),
    ("query_none", dict(query=None), "query"),
    ("key_none", dict(key=None), "key"),
    ("value_list", dict(value=[[1.0]]), "value"),
    ("mask_list", dict(attn_mask=[[True]]), "attn_mask"),
    ("sinks_list", dict(sinks=[0.0] * H), "sinks"),
    ("generator_str", dict(dropout_p=0.1, generator="x"), "generator"),
    # ints beyond float's range (OverflowError without a name)
    ("scale_huge_int", dict(scale=10**400), "scale"),
    ("temperature_huge_int", dict(temperature=10**400), "temperature"),
    ("train_length_huge_int", dict(scale="logn", train_length=10**400), "train_length"),
    ("softcap_huge_int", dict(softcap=10**400), "softcap"),
    # finite in float64, infinite in float32, in which the kernels of float32 inputs form lambda_i
    ("scale_beyond_float32", dict(scale=1e39), "scale"),
    ("temperature_below_float32", dict(temperature=1e-39), "temperature"),
    ("scale_over_temperature_beyond_float32", dict(scale=1e30, temperature=1e-10), "scale"),
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overrides,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_inputs_raise(device: str, overrides: Dict[str, Any], pattern: str) -> None:
    """Each bad input raises ValueError/TypeError mentioning the argument (tensors on `device`)."""
    with pytest.raises(ERR, match=pattern):
        call(device, **to_device(overrides, device))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_with_return_stats(device: str) -> None:
    """Validation also applies with return_stats=True and for the raw op."""
    with pytest.raises(ERR, match="temperature"):
        call(device, temperature=0.0, return_stats=True)
    q, k, v = (torch.randn(B, h, L, D, device=device) for h, L in ((H, Lq), (2, Lk), (2, Lk)))
    with pytest.raises(ERR, match="enable_gqa"):
        torch.ops.entropy_attn.attention(q, k, v)
    with pytest.raises(ERR, match="scale"):
        torch.ops.entropy_attn.attention(q, k, v, None, None, enable_gqa=True, scale_mode="bogus")
    with pytest.raises(ERR, match="temperature"):
        torch.ops.entropy_attn.attention(q, k, v, None, None, enable_gqa=True, temperature=-2.0)
    with pytest.raises(ERR, match="attn_mask"):
        torch.ops.entropy_attn.attention(
            q, k, v, torch.ones(Lq, Lk, dtype=torch.int32, device=device), None, enable_gqa=True
        )
    with pytest.raises(ERR, match="scale"):
        torch.ops.entropy_attn.attention(q, k, v, None, torch.ones(3, 3, device=device), enable_gqa=True)


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_raw_ops_name_a_missing_tensor(which: str) -> None:
    """torch.ops passes None for a Tensor argument as an undefined tensor, whose shape reads [0]:
    the raw ops raise TypeError naming it (they reported a 1-D tensor of shape [0])."""
    dense = dict(query=torch.randn(B, H, Lq, D), key=torch.randn(B, H, Lk, D), value=torch.randn(B, H, Lk, D))
    packed = dict(query=torch.randn(Lq, H, D), key=torch.randn(Lk, H, D), value=torch.randn(Lk, H, D))
    cu_q, cu_k = torch.tensor([0, Lq], dtype=torch.int32), torch.tensor([0, Lk], dtype=torch.int32)
    calls = [lambda a: torch.ops.entropy_attn.attention(a["query"], a["key"], a["value"]),
             lambda a: torch.ops.entropy_attn.varlen_attention(a["query"], a["key"], a["value"], cu_q, cu_k, Lq, Lk)]
    if which != "value":
        calls.append(lambda a: torch.ops.entropy_attn.attention_sparsity(a["query"], a["key"]))
    for args, fn in zip((dense, packed, dense), calls):
        with pytest.raises(TypeError, match=rf"^{which} must be a tensor, got None"):
            fn({**args, which: None})


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.cuda
@pytest.mark.parametrize("which", ["key", "value", "attn_mask", "scale"])
def test_mixed_devices(which: str) -> None:
    """Tensors on different devices raise, naming the argument."""
    over: Dict[str, Any] = {
        "query": torch.randn(B, H, Lq, D, device="cuda"),
        "key": torch.randn(B, H, Lk, D, device="cuda"),
        "value": torch.randn(B, H, Lk, D, device="cuda"),
        "attn_mask": torch.ones(Lq, Lk, dtype=torch.bool, device="cuda"),
        "scale": torch.ones(H, 1, device="cuda"),
    }
    over[which] = over[which].cpu()
    with pytest.raises(ERR, match=which):
        call(**over)


def test_other_entry_points_name_bad_arguments() -> None:
    """attention_sparsity's kind, length_factor's policy arguments, varlen_attention's max_q and
    replace_sdpa's mask batch raise naming the argument (they were dispatcher RuntimeErrors, a
    ValueError naming nothing, or expand's RuntimeError)."""
    q, k = torch.randn(B, H, Lq, D), torch.randn(B, H, Lk, D)
    with pytest.raises(TypeError, match="kind"):
        torch_ext.attention_sparsity(q, k, kind=None)
    # (it has no value: its messages named one, "query, key and value must have the same dtype")
    with pytest.raises(TypeError, match=r"^query and key must have the same dtype, got Double and Float"):
        torch_ext.attention_sparsity(q.double(), k)
    n = torch.arange(1, 5)
    for kw, name in ((dict(temperature="a"), "temperature"), (dict(train_length=None), "train_length"), (dict(scale=3), "scale")):
        with pytest.raises(ERR, match=name):
            torch_ext.length_factor(n, **kw)
    # (the float32 range check of the raw op leaves a NaN softcap to the check that names it)
    with pytest.raises(ValueError, match=r"^softcap must be 0 \(none\) or a finite number"):
        torch.ops.entropy_attn.attention(q, k, k, softcap=math.nan)
    t = torch.randn(5, H, D)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    for m in (2**70, -1):
        with pytest.raises(ValueError, match="max_q"):
            torch_ext.varlen_attention(t, t, t, cu, cu, m, 5)
    with torch_ext.replace_sdpa(), pytest.raises(ValueError, match="attn_mask"):
        torch.nn.functional.scaled_dot_product_attention(q, k, k, torch.zeros(B + 1, H, Lq, Lk))
    with torch_ext.replace_sdpa(), pytest.raises(ValueError, match="leading dims"):
        torch.nn.functional.scaled_dot_product_attention(q[0], k[0], k[0], torch.zeros(2, 1, Lq, Lk))
    mha = torch_ext.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 3, 8)
    for name in ("attn_mask", "key_padding_mask"):
        for inputs in (x, x[0]):  # batched and unbatched
            with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor or None, got list"):
                mha(inputs, inputs, inputs, **{name: [[True, True, False]]})


def test_float64_mask_values_beyond_float32_are_offsets() -> None:
    """A float64 additive mask with float32 inputs: finite values beyond float32's range are
    offsets, not masks (a plain cast made them -inf: out of n_i, and a row whose every key
    carried -1e300 gave 0 instead of attending uniformly), as with float64 inputs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, L, 4, dtype=torch.float64, generator=g) for L in (3, 6, 6))
    mask = torch.zeros(3, 6, dtype=torch.float64)
    mask[0, :2] = -1e300  # some keys of row 0 carry it
    mask[1] = -1e300  # every key of row 1: uniform over the 6 keys
    mask[2, 5] = float("-inf")  # masked
    for scale in (None, "logn"):
        want, want_stats = torch_ext.attention(q, k, v, mask, scale=scale, train_length=4, return_stats=True)
        got, stats = torch_ext.attention(q.float(), k.float(), v.float(), mask, scale=scale, train_length=4, return_stats=True)
        assert stats.n_keys.flatten().tolist() == want_stats.n_keys.flatten().tolist() == [6, 6, 5]
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want[0, 0, 1], v[0, 0].mean(0))


def test_float64_sinks_beyond_float32_are_sinks() -> None:
    """A float64 sink beyond float32's range with float32 inputs is a sink (-FLT_MAX: one more
    entry of each row's distribution, of weight 0), not the -inf of a plain cast, which is no sink
    and took the entry out of the statistics; as with float64 inputs and with -3.4e38."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 4, dtype=torch.float64, generator=g) for L in (3, 5, 5))
    sinks = torch.tensor([-1e300, 1e300], dtype=torch.float64)
    want, want_stats = torch_ext.attention(q, k, v, sinks=sinks, return_stats=True)
    got, stats = torch_ext.attention(q.float(), k.float(), v.float(), sinks=sinks, return_stats=True)
    near = torch.tensor([-3.4e38, 3.4e38])
    _, near_stats = torch_ext.attention(q.float(), k.float(), v.float(), sinks=near, return_stats=True)
    _, no_sink = torch_ext.attention(q.float(), k.float(), v.float(), return_stats=True)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    for name in ("normalized_entropy", "sparsity", "entropy", "max_weight"):
        torch.testing.assert_close(getattr(stats, name).double(), getattr(want_stats, name), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(getattr(stats, name), getattr(near_stats, name))
    # Head 0's sink carries no weight but counts: log(n + 1), not log(n), normalizes its entropy.
    assert not torch.allclose(stats.normalized_entropy[:, 0], no_sink.normalized_entropy[:, 0])
    torch.testing.assert_close(stats.entropy[:, 0], no_sink.entropy[:, 0])
    # Head 1's takes the whole weight: output 0, max weight 1.
    assert torch.equal(got[:, 1], torch.zeros_like(got[:, 1]))
    assert torch.equal(stats.max_weight[:, 1], torch.ones_like(stats.max_weight[:, 1]))


def test_dense_scale_tensors() -> None:
    """A scale or scale_factor tensor must be dense: a nested or sparse one raises a TypeError
    naming the argument (it reached the dispatcher: "Could not run ... SparseCPU", or a bare
    NotImplementedError), in attention, varlen_attention and attention_sparsity alike."""
    q = torch.randn(1, 2, 4, 8)
    jagged = torch.nested.nested_tensor([torch.ones(1), torch.ones(1)], layout=torch.jagged)
    sparse = torch.ones(2, 1).to_sparse()
    for name, kwargs in (("scale", dict(scale=jagged)), ("scale", dict(scale=sparse)),
                         ("scale_factor", dict(scale="logn", scale_factor=sparse))):
        for call in (lambda: torch_ext.attention(q, q, q, **kwargs),
                     lambda: torch_ext.attention_sparsity(q, q, **kwargs)):
            with pytest.raises(TypeError, match=f"^{name} must be a dense \\(strided\\) tensor, got layout"):
                call()
    packed = q[0].transpose(0, 1)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="^scale must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"):
        torch_ext.varlen_attention(packed, packed, packed, cu, cu, 4, 4, scale=torch.ones(1, 2).to_sparse())


STATS_OPS: Tuple[Tuple[str, Callable[..., Tensor]], ...] = (
    ("entropy", lambda *a, **k: torch_ext.entropy(*a, **k)),
    ("sparsity", lambda *a, **k: torch_ext.sparsity(*a, **k)),
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,fn", STATS_OPS, ids=[s[0] for s in STATS_OPS])
def test_stats_ops_bad_inputs(device: str, name: str, fn: Callable[..., Tensor]) -> None:
    """entropy / sparsity: integer input raises; an out-of-range dim raises naming `dim`."""
    with pytest.raises(ERR):
        fn(torch.ones(3, 4, dtype=torch.int64, device=device))
    with pytest.raises((ValueError, TypeError, IndexError), match="dim|[Dd]imension"):
        fn(torch.rand(3, 4, device=device), dim=2)
    with pytest.raises((ValueError, TypeError, IndexError), match="dim|[Dd]imension"):
        fn(torch.rand(3, 4, device=device), dim=-3)
    # Non-tensors and dims that are not ints: a TypeError naming the argument (the op's parser
    # raised a RuntimeError, and None "does not have a device").
    arg = "p" if name == "entropy" else "a"
    for bad in (None, [0.5, 0.5]):
        with pytest.raises(TypeError, match=f"^{arg} must be a torch.Tensor"):
            fn(bad)
    for dim in (1.5, None, True):
        with pytest.raises(TypeError, match="^dim must be an int"):
            fn(torch.rand(3, 4, device=device), dim=dim)


def _backward_args() -> Dict[str, Any]:
    """Valid arguments of attention_backward / attention_grad from a real float32 forward."""
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    res = torch.ops.entropy_attn.attention(q, k, v, return_stats=True)
    return dict(q=q, k=k, v=v, out=res[0], lse=res[1], ent=res[2], p2=res[3], n=res[5], rs=res[6], lf=res[7])


def test_backward_ops_name_bad_arguments() -> None:
    """The backward ops called directly check what they are given, naming it: one Meta tensor among
    CPU ones (the Meta kernel returned uninitialized gradients), integer saved rows (an integer
    row_scale gave a truncated integer gradient), attention_grad's own row tensors (broadcast
    silently, or ATen errors naming nothing) and the row reductions' upstream gradient."""
    a = _backward_args()
    ops = torch.ops.entropy_attn

    def backward(**over: Any) -> Any:
        x = {**a, **over}
        return ops.attention_backward(torch.ones_like(x["out"]), None, None, None, x["q"], x["k"], x["v"], None,
                                      x["out"], x["lse"], x["ent"], x["p2"], x["rs"], False)

    def grad(**over: Any) -> Any:
        x = {**a, **over}
        return ops.attention_grad(torch.ones_like(x["out"]), None, None, None, x.get("g_norm"), x.get("g_sp"), None,
                                  x["q"], x["k"], x["v"], None, x.get("scale"), x.get("sinks"), x["out"], x["lse"],
                                  x["ent"], x["p2"], x["n"], x["rs"], x["lf"], False, True,
                                  output_mask=[False, True, True])

    backward(), grad()  # control: valid
    cases: list[Tuple[type, str, Callable[[], Any]]] = [
        (ValueError, "lse must be on query's device", lambda: backward(lse=a["lse"].to("meta"))),
        (TypeError, "row_scale must be a floating-point tensor", lambda: backward(rs=a["rs"].long())),
        (ValueError, "grad_sparsity must have lse's shape", lambda: grad(g_sp=torch.ones(5))),
        (ValueError, "grad_normalized_entropy must have lse's shape", lambda: grad(g_norm=torch.ones(1))),
        (TypeError, "n_keys must be an integer tensor", lambda: grad(n=a["n"].float())),
        (ValueError, "length_factor must have lse's shape", lambda: grad(lf=a["lf"][:, :1])),
        # (return_stats=True with the empty statistics of a forward without them: an ATen shape error)
        (ValueError, r"sum_p2 must have lse's shape \[1, 2, 3\], got \[0\]", lambda: grad(p2=torch.empty(0))),
        (ValueError, r"entropy must have lse's shape \[1, 2, 3\], got \[0\]", lambda: grad(ent=torch.empty(0))),
        (ValueError, "scale tensor of shape .* does not broadcast", lambda: grad(scale=torch.ones(7))),
        # (the forward's check: an integer or bool scale got a truncated gradient, 0 or True)
        (TypeError, r"scale tensor .* must be float32, float64, bfloat16 or float16, got Long",
         lambda: grad(scale=torch.full((1,), 3))),
        (TypeError, r"scale tensor .* must be float32, float64, bfloat16 or float16, got Bool",
         lambda: grad(scale=torch.ones(1, dtype=torch.bool))),
        (TypeError, "^dtype must be torch.float32 or torch.float64, got str",
         lambda: torch_ext.length_factor(torch.arange(4), "logn", dtype="float32")),
        (ValueError, r"sinks must have shape \(heads,\)", lambda: grad(sinks=torch.zeros(2, 3))),
        (ValueError, "sinks must be on lse's device", lambda: grad(sinks=torch.zeros(2, device="meta"))),
        (ValueError, r"grad must have shape \[2\]", lambda: ops.entropy_backward(torch.ones(1), torch.rand(2, 3), 1)),
        (ValueError, "grad must be on p's device", lambda: ops.entropy_backward(torch.ones(2, device="meta"),
                                                                              torch.rand(2, 3), 1)),
        (ValueError, "temperature must be at least 1 / FLT_MAX",
         lambda: torch_ext.length_factor(torch.arange(4), temperature=1e-300)),
        (ValueError, "temperature must be a finite number > 0 with a finite inverse",
         lambda: ops.length_factor(torch.arange(4), "logn", 1e-320, 512.0, dtype=torch.float64)),
    ]
    for error, message, fn in cases:
        with pytest.raises(error, match=message):
            fn()


def test_nested_and_sparse_tensors_are_named() -> None:
    """A nested tensor of the strided layout (jagged ones run: tests/test_nested.py) and a sparse one
    raise errors naming the argument and, for nested ones, what to use instead, from attention and
    from the SDPA drop-in (the dispatcher said only the op's name, or which backend has no kernel)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (strided nested tensors are a prototype)
        x = torch.nested.nested_tensor([torch.randn(3, 4, 8), torch.randn(5, 4, 8)]).transpose(1, 2)
    dense = torch.randn(2, 4, 5, 8)
    with pytest.raises(NotImplementedError, match="query is a nested tensor of layout torch.strided.* torch.jagged"):
        torch_ext.attention(x, x, x)
    with torch_ext.replace_sdpa(), pytest.raises(NotImplementedError, match="query is a nested tensor"):
        torch.nn.functional.scaled_dot_product_attention(x, x, x)
    with pytest.raises(TypeError, match="key must be a dense \\(strided\\) tensor, got layout torch.sparse_coo"):
        torch_ext.attention(dense, dense.to_sparse(), dense)
