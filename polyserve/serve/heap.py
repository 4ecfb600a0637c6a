"""The C heap of a worker: freed memory kept for reuse between collections, and handed
back to the kernel at each one."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from collections.abc import Iterator

# mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Where glibc's dynamic thresholds end up on a 64-bit host (DEFAULT_MMAP_THRESHOLD_MAX,
# and twice it), and its initial trim threshold.
MMAP_THRESHOLD = 32 << 20
KEEP = 2 * MMAP_THRESHOLD
RETURN = 128 << 10
# While a space loads: glibc's initial mmap threshold.
LOADING = 128 << 10

_libc = ctypes.CDLL(None)
# glibc's; other C libraries go without, and keep what they keep.
_mallopt = getattr(_libc, "mallopt", None)
_malloc_trim = getattr(_libc, "malloc_trim", None)
_loads = 0  # loads under way, on the host's threads
_loads_lock = threading.Lock()


def settle() -> None:
    """Fix glibc's thresholds at the values its dynamic ones reach, once per worker.

    glibc raises its mmap threshold to the size of each mapped block that is freed (and
    the trim threshold to twice that), so after a space's large buffer is freed the next
    ones live in the heap, most of them in the arenas of the threads that imported them.
    There a freed block at the top of an arena's heap stays resident below the trim
    threshold, and malloc_trim does not release the top of any arena but the main one:
    a worker that held nothing kept its spaces' memory. Fixed thresholds make what the
    heap keeps the same for every worker; collect() hands it back."""
    if _mallopt is not None:
        _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        _mallopt(M_TRIM_THRESHOLD, KEEP)


def collect() -> None:
    """Run the cycle collector (a dropped space's modules are reference cycles) with the
    trim threshold lowered, so each free that reaches the top of an arena's heap returns
    that top to the kernel, then malloc_trim for the free blocks below it. Between
    collections the threshold is high again: a request's transient buffers are reused,
    not faulted in anew each time."""
    if _mallopt is not None:
        _mallopt(M_TRIM_THRESHOLD, RETURN)
    try:
        gc.collect()
        if _malloc_trim is not None:
            _malloc_trim(0)
    finally:
        if _mallopt is not None:
            _mallopt(M_TRIM_THRESHOLD, KEEP)


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """While a space loads, a block above LOADING is mapped on its own, and unmapped
    when freed.

    A load's transient buffers are large (onnxruntime reads a prepacked model's weights
    into one before it maps them), and at the fixed threshold they would live in the
    arena of the thread that imported them: freed at once, yet resident, since a free
    under the trim threshold keeps the top of its arena and malloc_trim releases the top
    of the main arena only. Each worker then held a copy of a shared model's weights.
    What the load keeps is mapped too, and goes back when its space is released. Requests
    that run meanwhile map their large blocks too, for the length of the load only."""
    global _loads
    if _mallopt is None:
        yield
        return
    with _loads_lock:
        _loads += 1
        if _loads == 1:
            _mallopt(M_MMAP_THRESHOLD, LOADING)
    try:
        yield
    finally:
        with _loads_lock:
            _loads -= 1
            if _loads == 0:
                _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
