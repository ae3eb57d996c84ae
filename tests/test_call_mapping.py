"""torch_ext.attention's short path for plain calls (attention.py: _plain_call, _plain_options)
gives the op the arguments the general path (_policy_args, _pattern_args, _explicit) gives, and
leaves to the general path every call whose arguments that path would check or map."""

from __future__ import annotations

import itertools
import math
import sys
from typing import Any, Dict

import numpy as np
import pytest
import torch

import torch_ext

A = sys.modules["torch_ext.attention"]

# _plain_call's arguments at attention()'s defaults.
DEFAULTS: Dict[str, Any] = dict(
    scale=None,
    temperature=1.0,
    train_length=512,
    scale_factor=None,
    window_size=A._NO_WINDOW,
    causal_alignment="top_left",
    softcap=None,
    dropout_p=0.0,
    generator=None,
)


def general_options(
    scale: float | str | None, scale_factor: float | None, train_length: int, is_causal: bool, enable_gqa: bool,
    return_stats: bool,
) -> Dict[str, Any]:
    """The op's keyword arguments from the general path of attention(), defaults left out."""
    scale_tensor, policy = A._policy_args(scale, 1.0, train_length, scale_factor)
    assert scale_tensor is None
    pattern = A._pattern_args(A._NO_WINDOW, "top_left", None, 0.0, None)
    options = dict(is_causal=is_causal, enable_gqa=enable_gqa, return_stats=return_stats, **policy, **pattern)
    return A._explicit(options, A._ATTENTION_DEFAULTS)


@pytest.mark.parametrize(
    "scale,scale_factor,train_length",
    [
        (None, None, 512),
        (0.5, None, 512),
        (0.0, None, 512),
        (-2.0, None, 4096),
        (1e30, None, 2),
        ("logn", None, 512),
        ("logn", 0.125, 512),
        ("logn", None, 4096),
        ("logn_sharpen", -0.5, 2),
        ("logn_sharpen", None, 2**53 - 1),
    ],
)
def test_plain_calls_map_as_the_general_path(scale: float | str | None, scale_factor: float | None,
                                             train_length: int) -> None:
    """For every flag combination, with and without sinks, the short path's keyword arguments are
    the general path's (sinks, which that path always passes, only when given)."""
    args = {**DEFAULTS, "scale": scale, "scale_factor": scale_factor, "train_length": train_length}
    assert A._plain_call(**args)
    sinks = torch.zeros(2)
    for is_causal, enable_gqa, return_stats, with_sinks in itertools.product((False, True), repeat=4):
        expected = general_options(scale, scale_factor, train_length, is_causal, enable_gqa, return_stats)
        if with_sinks:
            expected["sinks"] = sinks
        got = A._plain_options(scale, scale_factor, train_length, is_causal, enable_gqa, return_stats,
                               sinks if with_sinks else None)
        assert got == expected, (is_causal, enable_gqa, return_stats, with_sinks)
        assert all(type(got[k]) is type(expected[k]) for k in got)


@pytest.mark.parametrize(
    "name,value",
    [
        ("scale", float("nan")),
        ("scale", math.inf),
        ("scale", 2),  # an int: the general path converts it
        ("scale", np.float64(0.5)),
        ("scale", "fixed"),
        ("scale", np.str_("logn")),
        ("scale", torch.tensor(0.5)),
        ("scale_factor", 0.5),  # without a "logn" policy: the general path raises
        ("scale_factor", torch.tensor(0.5)),
        ("temperature", 2.0),
        ("temperature", 1),
        ("temperature", np.float64(1.0)),
        ("train_length", 512.0),
        ("train_length", 1),
        ("train_length", 2**53),
        ("train_length", 10**400),
        ("train_length", True),
        ("window_size", (-1, -1)[:]),  # equal, but not the default object: checked element by element
        ("window_size", (-1.0, -1.0)),
        ("window_size", [-1, -1]),
        ("causal_alignment", "bottom_right"),
        ("causal_alignment", np.str_("top_left")),
        ("softcap", 30.0),
        ("dropout_p", 0),
        ("dropout_p", 0.1),
        ("dropout_p", False),
        ("generator", torch.Generator()),
    ],
)
def test_other_arguments_take_the_general_path(name: str, value: Any) -> None:
    """Anything but a default (or a finite float scale), however close, is left to the checks."""
    assert not A._plain_call(**{**DEFAULTS, name: value})


@pytest.mark.parametrize("scale_factor", [float("nan"), -math.inf, 2, torch.tensor(0.5)])
def test_logn_scale_factors_that_take_the_general_path(scale_factor: Any) -> None:
    """A "logn" policy's scale_factor other than None or a finite float goes to the checks."""
    assert not A._plain_call(**{**DEFAULTS, "scale": "logn", "scale_factor": scale_factor})


def test_window_checked_by_identity() -> None:
    """A tuple built at run time equal to the default is not the default object."""
    assert not A._plain_call(**{**DEFAULTS, "window_size": tuple([-1, -1])})


def test_plain_calls_skip_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain calls run without _policy_args, _pattern_args and _explicit, with the general path's
    results; a call with a window goes through them."""
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    sinks = torch.randn(4)
    expected = [
        torch_ext.attention(q, k, v, enable_gqa=True),
        torch_ext.attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3, sinks=sinks, return_stats=True),
        torch_ext.attention(q, k, v, enable_gqa=True, scale="logn", scale_factor=0.2, train_length=4),
    ]

    def refuse(*args: Any) -> None:
        raise AssertionError("the general path ran")

    for helper in ("_policy_args", "_pattern_args", "_explicit"):
        monkeypatch.setattr(A, helper, refuse)
    got = [
        torch_ext.attention(q, k, v, enable_gqa=True),
        torch_ext.attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3, sinks=sinks, return_stats=True),
        torch_ext.attention(q, k, v, enable_gqa=True, scale="logn", scale_factor=0.2, train_length=4),
    ]
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0)
    torch.testing.assert_close(got[1][0], expected[1][0], rtol=0, atol=0)
    for a, b in zip(got[1][1], expected[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="general path"):
        torch_ext.attention(q, k, v, enable_gqa=True, window_size=(3, 0))


def test_under_a_transform_the_general_path_runs() -> None:
    """torch.func.grad needs the Python autograd of _functorch: the short path stays out."""
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    seen = []

    def f(q: torch.Tensor) -> torch.Tensor:
        seen.append(A._plain_call(**DEFAULTS))
        return torch_ext.attention(q, k, v).sum()

    g = torch.func.grad(f)(q)
    q.requires_grad_(True)
    (expected,) = torch.autograd.grad(f(q), q)
    assert seen == [False, True]
    torch.testing.assert_close(g, expected)
