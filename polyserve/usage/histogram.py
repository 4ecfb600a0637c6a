"""The usage histograms' fixed buckets: their bounds and the bucket of a value."""

from __future__ import annotations

from bisect import bisect_left

# Upper bounds (µs, inclusive, as Prometheus's `le`) from 0.5 ms to 10 s; one more bucket
# past the last bound counts the rest (+Inf). Fixed: the cells are laid out by them.
# The request durations and the streams' first bytes are bucketed by these.
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

# Rows per batch: powers of two from 1 to 1024, then +Inf. A batch of r rows goes to
# the bucket of the first power of two >= r, which (r - 1).bit_length() names.
ROW_BOUNDS = tuple(1 << k for k in range(11))
ROW_BUCKETS = len(ROW_BOUNDS) + 1
_LAST_ROW_BUCKET = ROW_BUCKETS - 1

# A batched call's time in the queue (µs), from its enqueue to its batch's start: a lone
# call starts at once, so the bounds begin far below a request's.
QUEUE_BOUNDS_US = (
    10,
    25,
    50,
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    1_000_000,
)
QUEUE_BUCKETS = len(QUEUE_BOUNDS_US) + 1
QUEUE_BOUNDS_NS = tuple(b * 1000 for b in QUEUE_BOUNDS_US)  # the batcher's clock: no division


def bucket(us: int) -> int:
    """The bucket of a duration: the first whose bound is >= us (BUCKETS - 1 past all)."""
    return bisect_left(BOUNDS_US, us)


def row_bucket(rows: int) -> int:
    """The bucket of a batch of `rows` rows (ROW_BUCKETS - 1 past 1024)."""
    found = (rows - 1).bit_length() if rows > 0 else 0
    return found if found < _LAST_ROW_BUCKET else _LAST_ROW_BUCKET


def queue_bucket(us: int) -> int:
    """The bucket of a time in the queue (QUEUE_BUCKETS - 1 past a second)."""
    return bisect_left(QUEUE_BOUNDS_US, us)


def names(prefix: str, bounds: tuple[int, ...] = BOUNDS_US, unit: str = "us") -> tuple[str, ...]:
    """Checkpoint names of a histogram's bucket cells, by bound."""
    return (*(f"{prefix}_le_{b}{unit}" for b in bounds), f"{prefix}_le_inf")
