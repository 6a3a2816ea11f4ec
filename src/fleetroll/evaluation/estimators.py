"""The statistics of an evaluation: plain Python, the standard library only.

* :func:`pass_at_k`: the unbiased pass@k estimator of Chen et al. (2021),
  ``1 - C(n-c, k) / C(n, k)``, computed as a product so that it neither
  overflows nor loses precision for large ``n``.
* :func:`wilson_interval`: a confidence interval for one task's success rate
  (its samples are independent draws of the same policy on the same task, a
  binomial proportion; Wilson's interval keeps its coverage at small ``n`` and
  at ``0/n`` or ``n/n``, where the normal approximation collapses to a point).
* :func:`bootstrap_interval`: a confidence interval for a mean over tasks (a
  percentile bootstrap that resamples *tasks*: the tasks are the sample drawn
  from the distribution an evaluation speaks for, and each task's own sampling
  noise is carried in its estimate).
* :func:`sign_flip_p`: a paired permutation test over tasks (is the mean
  per-task difference between two evaluations beyond what swapping the labels
  A and B per task gives?), exact up to :data:`EXACT_SIGN_FLIPS_MAX_TASKS`
  tasks with a difference, else Monte Carlo.
* :func:`fisher_exact_p`: whether two success counts of one task differ
  (Fisher's exact test, two-sided), and :func:`holm` to flag, among many
  tasks, only those whose difference survives the number of tests made.

Every random draw comes from a ``random.Random(seed)``: the same inputs give
the same intervals and p-values.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from statistics import NormalDist

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "CONFIDENCE",
    "EXACT_SIGN_FLIPS_MAX_TASKS",
    "PERMUTATIONS",
    "bootstrap_interval",
    "fisher_exact_p",
    "holm",
    "pass_at_k",
    "pass_at_ks",
    "sign_flip_p",
    "wilson_interval",
]

#: The confidence of every interval fleetroll reports.
CONFIDENCE = 0.95
#: Resamples of a bootstrap interval.
BOOTSTRAP_RESAMPLES = 2000
#: Random sign flips of a permutation test over more tasks than the exact limit.
PERMUTATIONS = 10_000
#: Up to this many non-zero differences, every one of the 2**n sign assignments is tried.
EXACT_SIGN_FLIPS_MAX_TASKS = 14


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``c`` successes among ``n`` samples.

    The probability that at least one of ``k`` samples drawn without
    replacement from the ``n`` is a success: ``1 - C(n-c, k) / C(n, k)``,
    computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``.

    Raises:
        ValueError: ``k`` is below 1 or above ``n`` (there are not ``k``
            samples to draw: the estimate does not exist), or ``c`` is not
            between 0 and ``n``.
    """
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, not {k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} scored samples; there are {n}")
    if not 0 <= c <= n:
        raise ValueError(f"successes must be between 0 and n={n}, not {c}")
    if n - c < k:
        return 1.0  # every draw of k holds a success
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def pass_at_ks(n: int, c: int, k: int) -> list[float]:
    """pass@1 … pass@k from ``c`` successes among ``n`` samples, in O(k).

    The same estimator as :func:`pass_at_k`, from ``C(n-c, j) / C(n, j) =
    prod_{t<j} (n-c-t) / (n-t)``: a product of factors in [0, 1], extended by
    one factor per j (no cancellation, no overflow).

    Raises:
        ValueError: as :func:`pass_at_k`.
    """
    pass_at_k(n, c, k)  # the same refusals
    values = []
    ratio = 1.0  # C(n-c, j) / C(n, j): no draw of j holds a success
    for j in range(1, k + 1):
        ratio *= max(0, n - c - (j - 1)) / (n - (j - 1))
        values.append(1.0 - ratio)
    return values


def _z(confidence: float) -> float:
    """The two-sided standard normal quantile of ``confidence`` (1.96 for 0.95)."""
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson's score interval for a success rate of ``successes`` out of ``n``.

    Raises:
        ValueError: ``n`` is below 1, or ``successes`` not between 0 and ``n``.
    """
    if n < 1:
        raise ValueError("an interval needs at least one sample")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be between 0 and n={n}, not {successes}")
    z = _z(confidence)
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # At 0/n and n/n the bound is exactly 0 or 1; rounding must not move it past.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def bootstrap_interval(
    values: Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float] | None:
    """A percentile bootstrap interval for the mean of ``values`` (one per task).

    None for fewer than two values: one task says nothing about the spread
    between tasks. When every value is the same the interval is that point.
    """
    if len(values) < 2:
        return None
    rng = random.Random(seed)
    n = len(values)
    means = sorted(math.fsum(rng.choices(values, k=n)) / n for _ in range(resamples))
    alpha = 1 - confidence
    return _quantile(means, alpha / 2), _quantile(means, 1 - alpha / 2)


def sign_flip_p(
    differences: Sequence[float], *, permutations: int = PERMUTATIONS, seed: int = 0
) -> float:
    """The two-sided p-value of a paired permutation (sign-flip) test of a zero mean.

    Under the null hypothesis (A and B are the same policy) each task's
    difference is as likely to have either sign. The p-value is the share of
    sign assignments whose mean is at least as far from zero as the one
    observed: all ``2**n`` of them when at most :data:`EXACT_SIGN_FLIPS_MAX_TASKS`
    differences are not zero (a zero is the same either way), else
    ``permutations`` random ones (counted with the observed one,
    so it is never 0). 1.0 for no differences.
    """
    # A zero difference is the same under either sign: only the others are flipped.
    differences = [d for d in differences if d != 0]
    n = len(differences)
    if n == 0:
        return 1.0
    observed = abs(math.fsum(differences))
    tolerance = 1e-9 * max(1.0, observed)
    if n <= EXACT_SIGN_FLIPS_MAX_TASKS:
        extreme = 0
        for signs in range(2**n):
            total = math.fsum(-d if signs >> i & 1 else d for i, d in enumerate(differences))
            extreme += abs(total) >= observed - tolerance
        return extreme / float(1 << n)
    rng = random.Random(seed)
    extreme = 1  # the observed assignment
    for _ in range(permutations):
        total = math.fsum(d if rng.random() < 0.5 else -d for d in differences)
        extreme += abs(total) >= observed - tolerance
    return extreme / (permutations + 1)


def fisher_exact_p(successes_a: int, n_a: int, successes_b: int, n_b: int) -> float:
    """Fisher's exact test (two-sided) that two success rates are the same.

    The 2×2 table is (successes, failures) of A and of B; the p-value sums
    the probabilities, given the margins, of every table no more likely than
    the one observed.

    Raises:
        ValueError: a count is out of range.
    """
    if not (0 <= successes_a <= n_a and 0 <= successes_b <= n_b):
        raise ValueError("successes must be between 0 and their number of samples")
    total = n_a + n_b
    successes = successes_a + successes_b
    if total == 0:
        return 1.0

    # In whole numbers (each table's count of ways, over the same denominator): exact.
    def ways(x: int) -> int:  # x successes among A's n_a
        return math.comb(n_a, x) * math.comb(n_b, successes - x)

    observed = ways(successes_a)
    low, high = max(0, successes - n_b), min(n_a, successes)
    extreme = sum(w for x in range(low, high + 1) if (w := ways(x)) <= observed)
    return extreme / math.comb(total, successes)


def holm(p_values: Sequence[float], alpha: float) -> list[bool]:
    """Which hypotheses Holm's step-down method rejects at family-wise level ``alpha``.

    The smallest p-value is compared with ``alpha/m``, the next with
    ``alpha/(m-1)``, and so on until one is not below its bound: among ``m``
    tasks compared, the chance of flagging any task whose rate did not change
    stays under ``alpha``.
    """
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    m = len(p_values)
    for rank, i in enumerate(order):
        if p_values[i] >= alpha / (m - rank):
            break
        rejected[i] = True
    return rejected
