"""The request-duration histogram's fixed buckets: bounds in µs and the bucket of a duration."""

from __future__ import annotations

from bisect import bisect_left

# Upper bounds (µs, inclusive, as Prometheus's `le`) from 0.5 ms to 10 s; one more bucket
# past the last bound counts the rest (+Inf). Fixed: the cells are laid out by them.
BOUNDS_US = (
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
)
BUCKETS = len(BOUNDS_US) + 1  # the last is +Inf


def bucket(us: int) -> int:
    """The bucket of a duration: the first whose bound is >= us (BUCKETS - 1 past all)."""
    return bisect_left(BOUNDS_US, us)


def names(prefix: str) -> tuple[str, ...]:
    """Checkpoint names of a histogram's bucket cells, by bound."""
    return (*(f"{prefix}_le_{b}us" for b in BOUNDS_US), f"{prefix}_le_inf")
