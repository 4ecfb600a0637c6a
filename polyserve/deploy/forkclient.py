"""A worker's side of the fork server: ask it for a validation child and wait for its exit.

The server listens on a socket in Linux's abstract namespace, named at random per master:
no path to clean up after a master killed with -9, none longer than sun_path's 108 bytes
under a deep data directory. Abstract sockets have no file permissions, so the server
accepts only peers of its own uid (SO_PEERCRED), the uid workers and tenant code already
run as.

Protocol (SOCK_SEQPACKET, one JSON message each): the worker sends {"argv", "env"} with
two fds, the child's stdout and stderr pipes (SCM_RIGHTS), and a third, its stdin, when
the space has secrets (a memfd the server passes on unread); the server answers {"pid"}
(the keeper's) once forked and {"returncode"} once the child is reaped (negative: the
signal that ended it, as subprocess reports). A worker that hangs up first (its deploy
timed out or was cancelled) gets its validation ended (polyserve.deploy.forkloop). The
master sends {"ping": true} and expects {"pong": true} (polyserve.deploy.forkserver). A
worker that finds the server stopped does not wait for it and spawns its validator.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from collections.abc import Mapping

from polyserve.deploy import sandbox

MAX_MESSAGE = 1 << 20  # a request carries the environment: a few KiB
HANDSHAKE_S = 5.0  # a live server forks at once; past this, spawn instead


def address(name: str) -> str:
    """The socket address of the fork server `name`."""
    return "\0" + name  # the abstract namespace: nothing on disk


def peer(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of the Unix socket `sock`."""
    cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", cred)
    return pid, uid


class Forked:
    """A validation child forked by the server, shaped as asyncio's Process is for the
    spawned validator: pid (its process group too), stdout, stderr, wait()."""

    def __init__(
        self,
        pid: int,
        client: socket.socket,
        pipes: list[tuple[asyncio.BaseTransport, asyncio.StreamReader]],
    ) -> None:
        self.pid = pid
        self.client = client
        self.pipes = pipes
        self.stdout, self.stderr = pipes[0][1], pipes[1][1]
        self.returncode: int | None = None
        self.server_gone = False  # the server ended before reporting the exit status

    async def wait(self) -> int | None:
        """The child's exit status; None if the fork server died first (its children
        die with it: PR_SET_PDEATHSIG)."""
        if self.client.fileno() == -1:  # already reported (or closed)
            return self.returncode
        loop = asyncio.get_running_loop()
        try:
            reply = await loop.sock_recv(self.client, MAX_MESSAGE)
            self.returncode = int(json.loads(reply)["returncode"])
        except (OSError, ValueError, KeyError, TypeError):
            self.server_gone = True
        self.client.close()
        return self.returncode

    def close(self) -> None:
        self.client.close()  # a server still running the child then kills its group
        for transport, _ in self.pipes:
            transport.close()


async def fork(
    name: str, argv: list[str], env: Mapping[str, str] | None, stdin: int | None = None
) -> Forked | None:
    """Ask the fork server `name` for a validation child running `argv` (with `stdin` as
    its stdin, else /dev/null); None when no server answers (not listening yet, or
    dead): the caller spawns one instead."""
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.setblocking(False)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pipes: list[tuple[asyncio.BaseTransport, asyncio.StreamReader]] = []
    try:
        try:
            await asyncio.wait_for(loop.sock_connect(client, address(name)), HANDSHAKE_S)
            # A stopped server would answer nothing: the master replaces it.
            if sandbox.stopped(peer(client)[0]):
                raise TimeoutError
            request = {"argv": argv, "env": None if env is None else dict(env)}
            fds = [out_w, err_w] if stdin is None else [out_w, err_w, stdin]
            socket.send_fds(client, [json.dumps(request).encode()], fds)
            reply = await asyncio.wait_for(loop.sock_recv(client, MAX_MESSAGE), HANDSHAKE_S)
            pid = int(json.loads(reply)["pid"])
        finally:
            os.close(out_w)  # the child holds the only write ends now
            os.close(err_w)
        # _reader owns each read end from its call on, failing or not.
        fd, out_r = out_r, -1
        pipes.append(await _reader(fd))
        fd, err_r = err_r, -1
        pipes.append(await _reader(fd))
    except BaseException as exc:
        # Cancelled (a deploy given up) included: nothing of this attempt may stay open.
        client.close()  # a server that forked after all kills that child on the hang-up
        for transport, _ in pipes:
            transport.close()
        for fd in (out_r, err_r):
            if fd != -1:
                os.close(fd)
        if isinstance(exc, (OSError, ValueError, KeyError, TypeError, TimeoutError)):
            return None
        raise
    return Forked(pid, client, pipes)


async def _reader(fd: int) -> tuple[asyncio.BaseTransport, asyncio.StreamReader]:
    """A stream reading the pipe `fd`, which it owns: closed here if that fails."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
    except BaseException:
        pipe.close()
        raise
    return transport, reader
