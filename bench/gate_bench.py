"""The key check's cost per request (polyserve/serve/gate.py), warm: a public space, a
private one with 1 and with 8 keys, and a rate-limited key, against an empty loop.

Alternating rounds in one process, as bench/meter_bench.py does. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

from polyserve.serve.gate import Gate
from polyserve.state import access
from polyserve.state.shm import Table
from polyserve.state.store import Store
from polyserve.usage.meter import CELLS

Headers = list[tuple[bytes, bytes]]


def timed(check: Callable[[str, Headers], int], space: str, headers: Headers, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        check(space, headers)
    return (time.perf_counter_ns() - t0) / n


def baseline(space: str, headers: Headers, n: int) -> float:
    """The same loop calling a function that does nothing."""

    def nothing(space: str, headers: Headers) -> int:
        return -1

    return timed(nothing, space, headers, n)


def setup(root: str) -> tuple[Gate, dict[str, Headers]]:
    store = Store(root, 16, 3)
    table = Table.anonymous(1, 16, CELLS)
    headers: dict[str, Headers] = {}
    plain = [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"bench"), (b"accept", b"*/*")]
    for space, keys, rate in (
        ("b/public", 0, None),
        ("b/one", 1, None),
        ("b/eight", 8, None),
        ("b/rated", 1, 1e9),
    ):
        with store.locked():
            store.slots.allocate(space, lambda _: False, None, sync=False)
        state = access.Access(private=keys > 0)
        minted = ""
        for _ in range(keys):
            state, answer = access.mint(state, space, rate)
            minted = str(answer["key"])
        if keys:
            access.write(store.root, space, state)
        # The last minted key: with 8, the loop compares every digest all the same.
        headers[space] = [*plain, (b"authorization", f"Bearer {minted}".encode())]
    return Gate(store, table), headers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        gate, headers = setup(root)
        spaces = list(headers)
        for space in spaces:  # the cold read, once: what follows is the warm path
            gate.check(space, headers[space])
        rounds: dict[str, list[float]] = {space: [] for space in spaces}
        base: list[float] = []
        for _ in range(args.rounds):
            base.append(baseline(spaces[0], headers[spaces[0]], args.n))
            for space in spaces:
                rounds[space].append(timed(gate.check, space, headers[space], args.n))
    b = statistics.median(base)
    result: dict[str, object] = {
        "scenario": "gate",
        "rounds": args.rounds,
        "checks_per_round": args.n,
        "baseline_ns_p50": round(b, 1),
    }
    labels = ("public", "private_1_key", "private_8_keys", "rated")
    for space, label in zip(spaces, labels, strict=True):
        result[f"{label}_ns_p50"] = round(statistics.median(rounds[space]) - b, 1)
    result["goal_ns"] = 1000
    print(json.dumps(result))


if __name__ == "__main__":
    main()
