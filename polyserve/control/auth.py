"""Who may write to the control plane: an admin token, per-owner tokens (stored hashed), loopback.

Tokens file (POLYSERVE_TOKENS_FILE): one `owner sha256-hex-of-token` pair per line,
`#` starts a comment. `python -m polyserve.control.auth add OWNER` appends a fresh token's
hash for OWNER and prints the token once; `python -m polyserve.control.auth admin-token` prints
a fresh admin token and the POLYSERVE_DEPLOY_TOKEN_SHA256 line for the host. The file is
read on each write request, so adding a token needs no restart.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

from polyserve import settings as settings_mod
from polyserve.errors import ClientError
from polyserve.names import is_owner, parse_space

# Named exit codes from sysexits.h, each meaning one thing (gunicorn's own are 1, 3, 4).
EXIT_BAD_TOKENS_FILE = os.EX_CONFIG  # 78: the master refused a bad tokens file
_HASH = re.compile(r"[0-9a-fA-F]{64}")

log = logging.getLogger("polyserve")


def digest(token: str) -> str:
    """What a token is kept and compared as (see settings.token_sha256)."""
    return settings_mod.token_sha256(token)


def load_tokens(path: Path) -> dict[str, list[str]]:
    """owner -> token hashes; a ValueError "path:line: what is wrong" for a bad file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the tokens file: {exc.strerror}") from None
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text") from None
    found: dict[str, list[str]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{path}:{number}"
        if len(fields) != 2:
            raise ValueError(
                f"{where}: expected `owner sha256-hex-of-token`, got {len(fields)} field(s)"
            )
        owner, hashed = fields
        if not is_owner(owner):  # the owner part of a space name; so never "*"
            raise ValueError(
                f"{where}: invalid owner {owner[:70]!r}: 1-64 of letters, digits, '.', '_',"
                " '-', not starting with '.'"
            )
        if not _HASH.fullmatch(hashed):
            raise ValueError(
                f"{where}: the token hash must be 64 hex digits (a SHA-256), got"
                f" {len(hashed)} characters"
            )
        found.setdefault(owner, []).append(hashed.lower())
    return found


def on_starting(server: Any, s: settings_mod.Settings) -> None:
    """The master's start (gunicorn's on_starting): a bad tokens file stops the host,
    named by file and line; gunicorn's own copy of the environment, which it would hand
    to a re-exec'd master and which every forked worker inherits, forgets a plaintext
    admin token as os.environ already has."""
    settings_mod.forget_token(server.cfg.env_orig)
    if s.tokens_file:
        try:
            load_tokens(Path(s.tokens_file))
        except ValueError as exc:
            server.log.error("POLYSERVE_TOKENS_FILE: %s", exc)
            sys.exit(EXIT_BAD_TOKENS_FILE)


class Auth:
    """Decides control-plane writes. Reads (usage, spaces, metrics) stay open."""

    def __init__(self, admin_sha256: str, tokens_file: str) -> None:
        # Only the digest: a space in the same process can read this object.
        self.admin = admin_sha256.lower() if admin_sha256 else None
        self.tokens_file = Path(tokens_file) if tokens_file else None

    @property
    def configured(self) -> bool:
        return self.admin is not None or self.tokens_file is not None

    def owners(self) -> dict[str, list[str]]:
        """owner -> token hashes, from the tokens file as it is now.

        The master refused a bad file at start. A file that goes bad or vanishes while
        the host runs fails closed: a JSON 503 to every owner-token write, and an error
        in the log, until it is fixed (the admin token still works, as it is checked
        first). Keeping the last good contents instead would keep honouring a token an
        operator revoked by editing or removing the file, and would keep doing so
        silently in any worker that read it before; refusing is the safe side for a
        check of who may change code, and reads and spaces keep serving meanwhile.
        """
        if self.tokens_file is None:
            return {}
        try:
            return load_tokens(self.tokens_file)
        except ValueError as exc:
            log.error("POLYSERVE_TOKENS_FILE: %s", exc)
            raise ClientError(
                503,
                "the host's tokens file (POLYSERVE_TOKENS_FILE) is unreadable or invalid;"
                " the host log says where",
            ) from None

    def identify(self, authorization: str | None, client: str | None) -> str:
        """Who is asking, before the body is read: "*" for the admin (or a loopback client
        on a host without tokens), an owner name, or a ClientError (401/403; 503 when the
        tokens file has gone bad)."""
        if not self.configured:
            if _loopback(client):
                return "*"
            raise ClientError(
                403,
                "control-plane writes from other hosts need a token: set"
                " POLYSERVE_DEPLOY_TOKEN_SHA256 (or POLYSERVE_DEPLOY_TOKEN) or"
                " POLYSERVE_TOKENS_FILE on the host and send Authorization: Bearer <token>",
            )
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ClientError(401, "this host requires a token: send Authorization: Bearer <token>")
        presented = digest(token.strip())
        if self.admin is not None and hmac.compare_digest(presented, self.admin):
            return "*"
        matched = None
        for owner, hashes in self.owners().items():
            for hashed in hashes:  # compare every hash: timing says nothing about which
                if hmac.compare_digest(presented, hashed):
                    matched = owner
        if matched is None:
            raise ClientError(401, "invalid token")
        return matched

    @staticmethod
    def allow(who: str, space: str) -> None:
        """An owner's token writes only owner/*; raises 403 otherwise."""
        owner = parse_space(space).split("/")[0]
        if who != "*" and who != owner:
            raise ClientError(403, f"this token may only write spaces of {who}/*", space=space)


def _loopback(client: str | None) -> bool:
    try:
        return client is not None and ipaddress.ip_address(client).is_loopback
    except ValueError:
        return False


def add_token(tokens_file: Path, owner: str) -> str:
    """Append a fresh token's hash for owner; returns the token (shown once)."""
    parse_space(f"{owner}/x")  # the owner part follows the space-name rule
    token = secrets.token_urlsafe(32)
    with open(tokens_file, "ab+") as f:
        if f.seek(0, os.SEEK_END):
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a last line without its newline must not swallow ours
                f.write(b"\n")
        f.write(f"{owner} {digest(token)}\n".encode())
    return token


def admin_token() -> tuple[str, str]:
    """A fresh admin token and its SHA-256 (for POLYSERVE_DEPLOY_TOKEN_SHA256)."""
    token = secrets.token_urlsafe(32)
    return token, digest(token)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m polyserve.control.auth", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="create a token for OWNER and print it once")
    add.add_argument("owner")
    add.add_argument("--file", default="tokens.txt", help="the tokens file (default: %(default)s)")
    sub.add_parser(
        "admin-token",
        help="print a fresh admin token, then the POLYSERVE_DEPLOY_TOKEN_SHA256=... line"
        " to start the host with (the host then never holds the token itself)",
    )
    args = parser.parse_args()
    if args.command == "admin-token":
        token, hashed = admin_token()
        print(
            "# line 1: the admin token, for deployers (Authorization: Bearer <token>);"
            " line 2: the host's setting",
            file=sys.stderr,
        )
        print(token)
        print(f"POLYSERVE_DEPLOY_TOKEN_SHA256={hashed}")
    else:
        print(add_token(Path(args.file), args.owner))


if __name__ == "__main__":
    main()
