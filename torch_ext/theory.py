"""Closed forms of the seed documents' results (``docs/math.md`` section 5), as torch functions.

Everything here takes tensors (or Python numbers, promoted to float64 tensors), broadcasts like
ordinary torch ops and uses torch ops only, so it runs on any device and in any float dtype. These
are the predictions that ``tests/test_theory.py`` checks against Monte Carlo computed with the
project's ops and that ``scripts/science_figures.py`` plots.

Sparsity (seed 003): for attention weights ``a_j = f(q . k_j)`` with keys ``k ~ N(mu, sigma^2 I)``
and ``n -> infinity``, the l1/l2 sparsity of a row is ``S = E|f(x)| / sqrt(E f(x)^2)`` with
``x = beta + gamma * eps``, ``eps ~ N(0, 1)``, ``beta = q . mu``, ``gamma = sigma * |q|``.

Entropy (seeds 000 and 002): the mean-field approximation ``H ~ ln n - lam (s_max - s_mean)`` and
the ``n -> infinity`` floor of ``H - ln n`` for softmax of ``cos(theta_j) / tau``.

Like torch's elementwise functions, these do not check that tensor arguments lie in the domain
each docstring states (that would read them on the host: a device sync): outside it a result is
NaN or a number without meaning (a negative ``gamma``, a ``rho`` outside ``[0, 1]``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "sparsity_exp",
    "sparsity_identity",
    "sparsity_relu2",
    "sparsity_relu2_beta_gamma",
    "sparsity_nonneg_linear",
    "sparsity_decay",
    "mean_field_entropy",
    "mean_field_entropy_from_scores",
    "two_point_entropy_gap",
    "entropy_floor",
    "entropy_floor_solution",
]

_SQRT_2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_PI_OVER_2 = math.sqrt(math.pi / 2.0)
_LOG_2PI = math.log(2.0 * math.pi)


def _as_tensor(x: Tensor | float) -> Tensor:
    """A tensor view of ``x``: tensors pass through, Python numbers become float64 scalars."""
    if isinstance(x, Tensor):
        return x if x.is_floating_point() else x.to(torch.get_default_dtype())
    return torch.tensor(float(x), dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# Sparsity S = E|f| / sqrt(E f^2)   (seed 003, docs/math.md section 5.4)
# --------------------------------------------------------------------------------------------


def sparsity_exp(gamma: Tensor | float) -> Tensor:
    """Sparsity of softmax attention, ``f = exp``: ``S = exp(-gamma^2 / 2)``.

    Independent of ``beta`` (a common shift of the logits cancels in the normalization); tends to
    0 as ``gamma = sigma |q|`` grows, so softmax attention can concentrate arbitrarily.
    """
    g = _as_tensor(gamma)
    return torch.exp(-0.5 * g * g)


def sparsity_identity(beta: Tensor | float, gamma: Tensor | float) -> Tensor:
    """Sparsity of plain linear attention, ``f = identity``.

    ``S = [sqrt(2/pi) gamma exp(-beta^2 / (2 gamma^2)) + beta erf(beta / (sqrt(2) gamma))]
    / sqrt(beta^2 + gamma^2)`` (mean of a folded normal over its root mean square).

    Even in ``beta``, at least ``sqrt(2/pi) ~ 0.798`` (reached at ``beta = 0``): linear attention
    cannot concentrate. ``gamma = 0`` gives 1 (all weights equal to ``beta``), and
    ``beta = gamma = 0`` gives 0 (an all-zero row, the convention of ``torch_ext.sparsity``).
    """
    b, g = torch.broadcast_tensors(_as_tensor(beta), _as_tensor(gamma))
    g_abs = g.abs()
    degenerate = g_abs == 0
    safe_g = torch.where(degenerate, torch.ones_like(g_abs), g_abs)
    a = b / safe_g  # divide by gamma: S depends on beta / gamma only
    # (hypot: sqrt(1 + a^2) overflowed for |a| > 1e154, giving 0 where S -> 1; an infinite a is 1)
    s = (_SQRT_2_OVER_PI * torch.exp(-0.5 * a * a) + a * torch.special.erf(a / _SQRT_2)) / torch.hypot(
        torch.ones_like(a), a
    )
    s = torch.where(a.isinf(), torch.ones_like(s), s)
    return torch.where(degenerate, (b != 0).to(s.dtype), s)


def _relu_moments_scaled(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(log c, B2, B4)`` with ``M2 = E[(a+eps)_+^2] = c x B2`` and ``M4 = E[(a+eps)_+^4] = c x^2 B4``
    for some ``x > 0``, so that ``S = M2 / sqrt(M4) = sqrt(c) B2 / sqrt(B4)``, each factor finite
    where ``M2`` and ``M4`` overflow, underflow or cancel (float64 ``a``):

    - ``a >= 0``: ``c = 1``, ``x = d^2`` with ``d = max(a, 1)`` (``M4 ~ a^4`` overflows past
      ``a ~ 1e77``): the plain formulas over ``d^2`` and ``d^4`` (every term is non-negative);
    - ``-10 < a < 0``: ``c = phi(a)``, ``x = 1``, with the Mills ratio ``Phi(a) / phi(a) = sqrt(pi/2)
      erfcx(-a/sqrt 2)``, which avoids the underflow of ``Phi(a)`` and ``phi(a)``;
    - ``a <= -10`` (``t = -a``), where that form cancels (``M4``'s terms agree to ``t^9 / 24``):
      the Mills ratio's asymptotic series ``sum_k (-1)^k (2k-1)!! / t^(2k+1)`` gives
      ``M2 = phi (2 / t^3) p2`` and ``M4 = phi (24 / t^5) p4``, with ``p2 = sum_{m>=1} (-1)^(m+1) m
      (2m-1)!! / t^(2m-2)`` and ``p4 = sum_{m>=2} (-1)^m m (m-1) (2m-1)!! / 6 / t^(2m-4)`` (30 terms
      leave < 1e-16 at t = 10): ``c = phi / t``, ``x = 1 / t^2``, ``B2 = 2 p2``, ``B4 = 24 p4``.
    """
    # a >= 0, over d^2 and d^4: M2 = (a^2+1) Phi(a) + a phi(a), M4 = (a^4+6a^2+3) Phi(a) + (a^3+5a) phi(a).
    a_pos = a.clamp(min=0.0)
    r = a_pos.clamp(max=1.0)  # a / d
    inv = 1.0 / a_pos.clamp(min=1.0)  # 1 / d
    cdf = torch.special.ndtr(a_pos)
    pdf = torch.exp(-0.5 * a_pos * a_pos - 0.5 * _LOG_2PI)
    b2_pos = (r * r + inv * inv) * cdf + r * inv * pdf
    b4_pos = (r**4 + 6.0 * r * r * inv * inv + 3.0 * inv**4) * cdf + (r**3 * inv + 5.0 * r * inv**3) * pdf
    # -10 < a < 0: the same with Phi(a) = phi(a) * mills, and phi(a) factored out.
    a_mid = a.clamp(min=-10.0, max=0.0)
    mills = _SQRT_PI_OVER_2 * torch.special.erfcx(-a_mid / _SQRT_2)
    b2_mid = (a_mid * a_mid + 1.0) * mills + a_mid
    b4_mid = (a_mid**4 + 6.0 * a_mid * a_mid + 3.0) * mills + (a_mid**3 + 5.0 * a_mid)
    log_c_mid = -0.5 * a_mid * a_mid - 0.5 * _LOG_2PI
    # a <= -10: the series (Horner, smallest terms first).
    t = (-a).clamp(min=10.0)
    u = 1.0 / (t * t)
    p2, p4 = torch.zeros_like(t), torch.zeros_like(t)
    for m in range(30, 0, -1):
        p2 = p2 * u + float((-1) ** (m + 1) * m * _double_factorial(2 * m - 1))
    for m in range(31, 1, -1):
        p4 = p4 * u + (-1) ** m * m * (m - 1) * _double_factorial(2 * m - 1) / 6
    log_c_tail = -0.5 * t * t - 0.5 * _LOG_2PI - torch.log(t)

    tail, mid = a <= -10.0, a < 0
    log_c = torch.where(tail, log_c_tail, torch.where(mid, log_c_mid, torch.zeros_like(a)))
    b2 = torch.where(tail, 2.0 * p2, torch.where(mid, b2_mid, b2_pos))
    b4 = torch.where(tail, 24.0 * p4, torch.where(mid, b4_mid, b4_pos))
    return log_c, b2, b4


def _double_factorial(n: int) -> int:
    """``n!! = n (n - 2) (n - 4) ...`` (1 for ``n <= 0``)."""
    return math.prod(range(n, 0, -2))


def sparsity_relu2(a: Tensor | float) -> Tensor:
    """Sparsity of relu^2 attention (original GAU), ``f = relu(x)^2``, as a function of
    ``a = beta / gamma``.

    With ``Phi``, ``phi`` the standard normal cdf and pdf,
    ``M2 = (a^2 + 1) Phi(a) + a phi(a)``, ``M4 = (a^4 + 6 a^2 + 3) Phi(a) + (a^3 + 5 a) phi(a)``
    (``E[(a+eps)_+^2]`` and ``E[(a+eps)_+^4]``) and ``S = M2 / sqrt(M4)``.

    ``S(0) = 1/sqrt(6) ~ 0.408``; tends to 1 as ``a -> +inf`` and to 0 only as ``a -> -inf``
    (a negative bias ``beta``). Finite at every ``a`` (1 at ``+inf``, 0 at ``-inf``): the moments
    are taken in a scaled form that neither overflows nor cancels (:func:`_relu_moments_scaled`),
    in float64 whatever ``a``'s dtype (relative error below 1.5e-9 against 100-digit arithmetic,
    worst near ``a = -10``), and ``S`` is returned in ``a``'s dtype.
    """
    a_in = _as_tensor(a)
    log_c, b2, b4 = _relu_moments_scaled(a_in.to(torch.float64))
    # S = sqrt(c) B2 / sqrt(B4)
    return (torch.exp(0.5 * log_c) * b2 / torch.sqrt(b4)).to(a_in.dtype)


def sparsity_relu2_beta_gamma(beta: Tensor | float, gamma: Tensor | float) -> Tensor:
    """:func:`sparsity_relu2` at ``a = beta / gamma`` (``gamma > 0``)."""
    return sparsity_relu2(_as_tensor(beta) / _as_tensor(gamma))


def sparsity_nonneg_linear(q_dot_mu: Tensor | float, q_sigma_q: Tensor | float) -> Tensor:
    """Sparsity of non-negative linear attention ``a_j = q' . k'_j >= 0``.

    With ``k'`` of mean ``mu'`` and covariance ``Sigma'``: ``S = (q'.mu') / sqrt((q'.mu')^2 +
    q'^T Sigma' q')``. Arguments: ``q'.mu'`` (> 0) and ``q'^T Sigma' q'`` (>= 0).
    """
    m = _as_tensor(q_dot_mu)
    v = _as_tensor(q_sigma_q)
    return m / torch.sqrt(m * m + v)


def sparsity_decay(lam: Tensor | float, n: Tensor | int) -> Tensor:
    """Sparsity of a decaying linear RNN's weights ``a = (lam^(n-1), ..., lam, 1)``.

    ``S = [(1 - lam^n) / (1 - lam)] / sqrt(n (1 - lam^(2n)) / (1 - lam^2))`` for ``0 <= lam < 1``
    (``lam = 1`` gives 1, a uniform row). Tends to 0 like ``sqrt((1 + lam) / ((1 - lam) n))`` as
    ``n -> infinity``: sparse, but only as a fixed decay with distance. ``S`` depends on the
    weights' magnitudes only, so a negative ``lam`` (alternating signs) gives that of ``|lam|``
    (the logarithm below gave NaN), and ``lam > 1`` that of the reversed row, ``1 / lam``.
    """
    lam_t = _as_tensor(lam).abs()
    # (the reversed row of 1 / lam: lam^(2n) overflowed for lam > 1, inf / inf)
    lam_t = torch.where(lam_t > 1, 1 / lam_t, lam_t)
    n_t = torch.as_tensor(n, dtype=lam_t.dtype, device=lam_t.device)
    lam_t, n_t = torch.broadcast_tensors(lam_t, n_t)
    one = lam_t == 1
    safe = torch.where(one, torch.full_like(lam_t, 0.5), lam_t)
    log_lam = torch.log(safe)  # -inf at lam = 0: expm1(-inf) = -1, as it should
    l1 = -torch.expm1(n_t * log_lam) / (1.0 - safe)  # sum_k lam^k, k < n
    l2 = -torch.expm1(2.0 * n_t * log_lam) / (1.0 - safe * safe)  # sum_k lam^(2k)
    # (at most 1, as every S: near lam = 1 the quotient's rounding passed it, 1 + 1e-7 in float32)
    s = (l1 / torch.sqrt(n_t * l2)).clamp(max=1.0)
    return torch.where(one, torch.ones_like(s), s)


# --------------------------------------------------------------------------------------------
# Entropy (seeds 000, 002)
# --------------------------------------------------------------------------------------------


def mean_field_entropy(
    n: Tensor | float, lam: Tensor | float, s_max: Tensor | float, s_mean: Tensor | float
) -> Tensor:
    """Mean-field entropy of ``softmax(lam * s)`` (seed 002): ``H ~ ln n - lam (s_max - s_mean)``.

    Replaces ``ln mean_j exp(lam s_j)`` by ``lam * s_mean`` (average before exponentiating) and
    ``sum_j p_j s_j`` by ``s_max``. By Jensen's inequality and ``sum_j p_j s_j <= s_max`` both
    replacements can only lower ``H`` (for ``lam >= 0``): it is a lower bound, equal to ``H`` when
    all scores are equal, and the reason why ``lam`` proportional to ``ln n`` keeps it constant
    when ``s_max - s_mean`` does not depend on ``n``.
    """
    n_t = _as_tensor(n)
    return torch.log(n_t) - _as_tensor(lam) * (_as_tensor(s_max) - _as_tensor(s_mean))


def mean_field_entropy_from_scores(
    scores: Tensor, lam: Tensor | float, mask: Tensor | None = None, dim: int = -1
) -> Tensor:
    """:func:`mean_field_entropy` of the rows of ``scores`` (raw scores ``s``, before ``lam``).

    ``mask`` (bool, True = allowed, broadcastable to ``scores``) restricts each row to its allowed
    entries; ``n`` is then their count. ``lam`` broadcasts against the reduced shape.
    """
    if mask is None:
        mask = torch.ones_like(scores, dtype=torch.bool)
    mask = mask.expand_as(scores)
    n = mask.sum(dim=dim).to(scores.dtype)
    s_max = scores.masked_fill(~mask, float("-inf")).amax(dim=dim)
    s_mean = scores.masked_fill(~mask, 0.0).sum(dim=dim) / n
    return mean_field_entropy(n, lam, s_max, s_mean)


def two_point_entropy_gap(rho: Tensor | float, tau: Tensor | float) -> Tensor:
    """``H - ln n`` of softmax over logits ``cos(theta_j) / tau`` when a fraction ``rho`` of the
    keys has ``cos = +1`` and the rest ``cos = -1``.

    Exact for any ``n`` with ``rho * n`` an integer (it depends only on the empirical distribution
    of the logits): with ``c = 2 / tau`` and ``w = rho + (1 - rho) e^-c``,
    ``H - ln n = ln w + c (1 - rho) e^-c / w`` (written so that nothing overflows for small tau).
    """
    rho_t, tau_t = torch.broadcast_tensors(_as_tensor(rho), _as_tensor(tau))
    c = 2.0 / tau_t
    log_rho = torch.log(rho_t)
    log_rest = torch.log1p(-rho_t) - c
    log_w = torch.logaddexp(log_rho, log_rest)
    return log_w + c * torch.exp(log_rest - log_w)


def _log_sigmoid(z: Tensor) -> Tensor:
    """``log sigmoid(z) = min(z, 0) - log1p(exp(-|z|))``, exact for any ``z``. (``F.logsigmoid`` is
    about 1000x slower on small float64 CPU tensors in torch 2.14, and ``softplus`` switches to the
    identity above its threshold, an absolute error up to ~2e-9.)"""
    return torch.clamp(z, max=0.0) - torch.log1p(torch.exp(-z.abs()))


def _gap_logit(z: Tensor, c: Tensor) -> Tensor:
    """:func:`two_point_entropy_gap` with ``rho = sigmoid(z)`` and ``c = 2 / tau`` (stable in z)."""
    log_rho = _log_sigmoid(z)
    log_rest = _log_sigmoid(-z) - c
    log_w = torch.logaddexp(log_rho, log_rest)
    return log_w + c * torch.exp(log_rest - log_w)


def entropy_floor_solution(
    tau: Tensor | float, grid_points: int = 2049, iterations: int = 80
) -> tuple[Tensor, Tensor]:
    """The ``n -> infinity`` floor of ``H - ln n`` for softmax of ``cos(theta_j) / tau`` and the mass
    ``rho`` that attains it: ``(floor, rho)``, both shaped like ``tau``.

    The minimum over distributions of ``cos theta`` on ``[-1, 1]`` is a two-point distribution at
    ``+-1`` (seed 000's comment; checked in the tests against free five-point distributions and
    random configurations), so the floor is ``min over rho in (0, 1)`` of
    :func:`two_point_entropy_gap`. That one-dimensional minimum is found numerically, vectorized
    over ``tau``: a dense grid in ``z = logit(rho)`` (the optimal ``rho`` is about
    ``(2/tau) e^(-2/tau)`` for small ``tau``, far below any linear grid's spacing) on
    ``[-(2/tau) - 40, 40]``, then golden-section refinement in the bracket around the grid minimum.
    ``rho = 0`` and ``rho = 1`` (uniform weights, gap 0) are never the minimum.

    About ``-0.4745`` at ``tau = 1`` (the seed's number); decreasing in ``tau``, tending to
    ``-(2/tau - 1 - ln(2/tau))`` for small ``tau`` (so ``H`` can reach 0 at finite ``n``), and to 0
    as ``tau -> infinity``. Computed in float64 (float64 result unless ``tau`` is another float
    tensor, to whose dtype it is cast back).
    """
    tau_in = _as_tensor(tau)
    if not bool((tau_in > 0).all()):
        raise ValueError("tau must be > 0")
    # (a grid of one point is its own minimum, at rho's lower end: a floor of 0)
    for name, value, least in (("grid_points", grid_points, 2), ("iterations", iterations, 0)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    tau64 = tau_in.to(torch.float64)
    c = (2.0 / tau64).unsqueeze(-1)  # (..., 1)
    lo = -c - 40.0
    hi = torch.full_like(c, 40.0)
    t = torch.linspace(0.0, 1.0, grid_points, dtype=torch.float64, device=tau64.device)
    z = lo + (hi - lo) * t  # (..., G)
    f = _gap_logit(z, c)
    k = f.argmin(dim=-1, keepdim=True)
    step = (hi - lo) / (grid_points - 1)
    a = lo + (k - 1).clamp(min=0) * step
    b = lo + (k + 1).clamp(max=grid_points - 1) * step
    # Golden-section search on the (unimodal near the grid minimum) bracket [a, b].
    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    x1 = b - inv_phi * (b - a)
    x2 = a + inv_phi * (b - a)
    f1 = _gap_logit(x1, c)
    f2 = _gap_logit(x2, c)
    for _ in range(iterations):
        left = f1 < f2  # minimum in [a, x2]
        b = torch.where(left, x2, b)
        a = torch.where(left, a, x1)
        new_x1 = b - inv_phi * (b - a)
        new_x2 = a + inv_phi * (b - a)
        # left: (x1, x2) <- (new x1, old x1); right: (x1, x2) <- (old x2, new x2).
        x1, f1, x2, f2 = (
            torch.where(left, new_x1, x2),
            torch.where(left, _gap_logit(new_x1, c), f2),
            torch.where(left, x1, new_x2),
            torch.where(left, f1, _gap_logit(new_x2, c)),
        )
    z_gold = 0.5 * (a + b)
    f_gold = _gap_logit(z_gold, c)
    better = f_gold <= f.gather(-1, k)  # never worse than the grid minimum
    floor = torch.where(better, f_gold, f.gather(-1, k)).squeeze(-1)
    rho = torch.sigmoid(torch.where(better, z_gold, z.gather(-1, k))).squeeze(-1)
    # (tau itself: _as_tensor gives an integer tensor the default dtype, float32)
    out_dtype = tau.dtype if isinstance(tau, Tensor) and tau.is_floating_point() else torch.float64
    return floor.to(out_dtype), rho.to(out_dtype)


def entropy_floor(tau: Tensor | float) -> Tensor:
    """The ``n -> infinity`` floor of ``H - ln n`` for softmax of ``cos(theta_j) / tau`` (seed 000).

    ``H >= ln n + entropy_floor(tau)`` for every configuration of the keys (at any ``n``); about
    ``-0.4745`` at ``tau = 1``, lower for smaller ``tau``. See :func:`entropy_floor_solution`.
    """
    return entropy_floor_solution(tau)[0]
