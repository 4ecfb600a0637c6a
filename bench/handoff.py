"""What routing by space would cost: a fresh connection answered by the process that
accepted it (A), against one handed to another process over a Unix socket (SCM_RIGHTS,
with the request bytes already read) that answers it (B), as a worker would hand a
request to the worker holding its space. Raw sockets, one client, alternated.

Prints one JSON object: p50 µs of each and the difference. docs/models.md explains the
decision it informed. Run alone: `python bench/handoff.py --n 2000`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
REQUEST = b"GET /s/owner/name/ HTTP/1.1\r\nHost: x\r\n\r\n"


def owner(channel: socket.socket) -> None:
    """The other worker: gets the connection and what was read from it, answers it."""
    while True:
        request, fds, _, _ = socket.recv_fds(channel, 4096, 1)
        if not fds or not request:
            os._exit(0)
        with socket.socket(fileno=fds[0]) as conn:
            conn.sendall(RESPONSE)


def acceptor(listener: socket.socket, channel: socket.socket) -> None:
    """The accepting worker: reads the request, then answers it or hands it over."""
    while True:
        conn, _ = listener.accept()
        request = conn.recv(4096)
        if request.startswith(b"GET /s/owner/name/?handoff"):
            socket.send_fds(channel, [request], [conn.fileno()])
        else:
            conn.sendall(RESPONSE)
        conn.close()


def call(port: int, handoff: bool) -> float:
    request = REQUEST.replace(b"/ HTTP", b"/?handoff HTTP") if handoff else REQUEST
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(request)
        while s.recv(4096):
            pass
    return (time.perf_counter() - t0) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000, help="calls of each kind")
    args = parser.parse_args()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    children = [os.fork()]
    if children[0] == 0:
        owner(theirs)
    children.append(os.fork())
    if children[1] == 0:
        acceptor(listener, ours)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.n * 2):
        handoff = bool(i % 2)
        times[handoff].append(call(port, handoff))
    for pid in children:
        os.kill(pid, 15)
        os.waitpid(pid, 0)
    direct, handed = (statistics.median(times[h][args.n // 10 :]) for h in (False, True))
    print(
        json.dumps(
            {
                "direct_p50_us": round(direct, 1),
                "handoff_p50_us": round(handed, 1),
                "added_p50_us": round(handed - direct, 1),
                "n": args.n,
            }
        )
    )


if __name__ == "__main__":
    main()
