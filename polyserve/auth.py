"""Who may write to the control plane: an admin token, per-owner tokens (stored hashed), loopback.

Tokens file (POLYSERVE_TOKENS_FILE): one `owner sha256-hex-of-token` pair per line,
`#` starts a comment. `python -m polyserve.auth add OWNER` appends a fresh token's
hash for OWNER and prints the token once. The file is read on each write request, so
adding a token needs no restart.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import secrets
from pathlib import Path

from polyserve.store import StoreError, parse_space


def digest(token: str) -> str:
    # Tokens are 256-bit random strings, so a plain SHA-256 is enough to keep them out
    # of the file; a slow password hash would only slow every deploy down.
    return hashlib.sha256(token.encode()).hexdigest()


class Auth:
    """Decides control-plane writes. Reads (usage, spaces, metrics) stay open."""

    def __init__(self, admin_token: str, tokens_file: str) -> None:
        self.admin = digest(admin_token) if admin_token else None
        self.tokens_file = Path(tokens_file) if tokens_file else None

    @property
    def configured(self) -> bool:
        return self.admin is not None or self.tokens_file is not None

    def owners(self) -> dict[str, list[str]]:
        """owner -> token hashes, from the tokens file as it is now."""
        found: dict[str, list[str]] = {}
        if self.tokens_file is None:
            return found
        for line in self.tokens_file.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                owner, hashed = line.split()
                found.setdefault(owner, []).append(hashed.lower())
        return found

    def identify(self, authorization: str | None, client: str | None) -> str | None:
        """Who is asking, before the body is read: "*" for the admin (or a loopback client
        on a host without tokens), an owner name, or a StoreError (401/403)."""
        if not self.configured:
            if _loopback(client):
                return "*"
            raise StoreError(
                403,
                "control-plane writes from other hosts need a token: set"
                " POLYSERVE_DEPLOY_TOKEN or POLYSERVE_TOKENS_FILE on the host and send"
                " Authorization: Bearer <token>",
            )
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise StoreError(401, "this host requires a token: send Authorization: Bearer <token>")
        presented = digest(token.strip())
        if self.admin is not None and hmac.compare_digest(presented, self.admin):
            return "*"
        matched = None
        for owner, hashes in self.owners().items():
            for hashed in hashes:  # compare every hash: timing says nothing about which
                if hmac.compare_digest(presented, hashed):
                    matched = owner
        if matched is None:
            raise StoreError(401, "invalid token")
        return matched

    @staticmethod
    def allow(who: str, space: str) -> None:
        """An owner's token writes only owner/*; raises 403 otherwise."""
        owner = parse_space(space).split("/")[0]
        if who != "*" and who != owner:
            raise StoreError(403, f"this token may only write spaces of {who}/*", space=space)


def _loopback(client: str | None) -> bool:
    try:
        return client is not None and ipaddress.ip_address(client).is_loopback
    except ValueError:
        return False


def add_token(tokens_file: Path, owner: str) -> str:
    """Append a fresh token's hash for owner; returns the token (shown once)."""
    parse_space(f"{owner}/x")  # the owner part follows the space-name rule
    token = secrets.token_urlsafe(32)
    with open(tokens_file, "a") as f:
        f.write(f"{owner} {digest(token)}\n")
    return token


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m polyserve.auth", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="create a token for OWNER and print it once")
    add.add_argument("owner")
    add.add_argument("--file", default="tokens.txt", help="the tokens file (default: %(default)s)")
    args = parser.parse_args()
    print(add_token(Path(args.file), args.owner))


if __name__ == "__main__":
    main()
