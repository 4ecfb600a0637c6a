"""A rollout's choice on the request path, alone: the word check when no rollout runs, and
`Split.choose` while one does (a random draw, and a sticky header's hash); prints JSON of
ns per call, an empty call's cost taken off."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import timeit

from polyserve.serve.split import Split
from polyserve.state import rollouts
from polyserve.state.shm import Table
from polyserve.state.store import Store
from polyserve.usage.meter import CELLS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        store = Store(root, 4)
        table = Table.anonymous(1, 4, CELLS)
        split = Split(store, table)
        space = "bench/split"
        rollouts.write(store.root, {"space": space, "sticky_header": "x-user"})
        headers = [(b"host", b"127.0.0.1"), (b"x-user", b"alice")]
        plain = [(b"host", b"127.0.0.1")]
        words = split.words

        def none() -> None:
            if words[1]:
                split.choose(1, space, plain)

        def drawn() -> None:
            if words[0]:
                split.choose(0, space, plain)

        def sticky() -> None:
            if words[0]:
                split.choose(0, space, headers)

        def empty() -> None:
            pass

        table.rollouts[0] = rollouts.word(2, 25)
        found: dict[str, list[float]] = {k: [] for k in ("empty", "none", "drawn", "sticky")}
        for _ in range(args.rounds):
            for name, func in (
                ("empty", empty),
                ("none", none),
                ("drawn", drawn),
                ("sticky", sticky),
            ):
                found[name].append(timeit.timeit(func, number=args.n) / args.n * 1e9)
        base = statistics.median(found["empty"])
        print(
            json.dumps(
                {k: round(statistics.median(v) - base, 1) for k, v in found.items() if k != "empty"}
            )
        )


if __name__ == "__main__":
    main()
