"""Named admin tokens: operators (may change the fleet) and viewers (read only), one token per person or
service, so the audit log says who did what.

Only a token's SHA-256 is stored (tokens are 32 random bytes, so a plain hash cannot be brute-forced); the
plaintext is shown once, at creation. `match_admin_token` compares the presented token's hash with every
active entry in constant time. `fleet admin-token create|revoke|list` is the command line.
"""
from __future__ import annotations

import argparse
import hmac
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from registry.queries import RegistryError, audit, bump_version, hash_api_key
from registry.schema import AdminToken, utcnow

ROLES = ("operator", "viewer")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")


@dataclass(frozen=True)
class AdminIdentity:
    token_hash: str
    name: str
    role: str


def new_admin_token(role: str) -> str:
    return ("fa-" if role == "operator" else "fv-") + secrets.token_urlsafe(32)


def set_admin_token(session: Session, name: str, role: str, token: str | None = None, actor: str = "cli") -> str:
    """Create (or re-key a revoked or rotated) token `name` with `role`; returns the plaintext token."""
    if not NAME_RE.match(name):
        raise RegistryError(f"name {name[:64]!r}: use 1-64 characters of A-Z a-z 0-9 _ . @ -")
    if role not in ROLES:
        raise RegistryError(f"role {role!r} is not one of {list(ROLES)}")
    token = token or new_admin_token(role)
    row = session.get(AdminToken, name)
    if row is None:
        row = AdminToken(name=name)
        session.add(row)
    row.role, row.token_hash, row.revoked_at, row.created_at = role, hash_api_key(token), None, utcnow()
    audit(session, actor, "admin_token_set", name, None, {"role": role})
    bump_version(session)
    return token


def ensure_admin_token(session: Session, name: str, role: str, token: str) -> None:
    """Make `token` the active token `name` unless it already is (used by `fleet seed`)."""
    row = session.get(AdminToken, name)
    if row is None or row.revoked_at is not None or row.role != role or \
            not hmac.compare_digest(row.token_hash, hash_api_key(token)):
        set_admin_token(session, name, role, token, actor="fleet-seed")


def revoke_admin_token(session: Session, name: str, actor: str = "cli") -> None:
    row = session.get(AdminToken, name)
    if row is None or row.revoked_at is not None:
        raise RegistryError(f"no active admin token named {name[:64]!r}")
    row.revoked_at = utcnow()
    audit(session, actor, "admin_token_revoke", name, {"role": row.role}, None)
    bump_version(session)


def list_admin_tokens(session: Session) -> list[AdminToken]:
    return list(session.scalars(select(AdminToken).order_by(AdminToken.name)))


def active_identities(session: Session) -> tuple[AdminIdentity, ...]:
    return tuple(AdminIdentity(t.token_hash, t.name, t.role) for t in list_admin_tokens(session) if t.revoked_at is None)


def match_admin_token(identities: tuple[AdminIdentity, ...], token: str) -> AdminIdentity | None:
    """The identity of `token`: every entry is compared, in constant time, whichever matches."""
    presented, found = hash_api_key(token), None
    for ident in identities:
        if hmac.compare_digest(ident.token_hash, presented):
            found = ident
    return found


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("admin-token", help="create, revoke or list named operator/viewer tokens (stored hashed)")
    actions = p.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create (or rotate) a token and print it once")
    create.add_argument("--name", required=True, help="who holds it (shown as the audit log's actor)")
    create.add_argument("--role", required=True, choices=ROLES, help="operator: may change the fleet; viewer: read")
    revoke = actions.add_parser("revoke", help="revoke a token at once (routers see it within a second)")
    revoke.add_argument("--name", required=True)
    actions.add_parser("list", help="list token names, roles and states (never the tokens)")
    p.set_defaults(handler=_main)


def _main(args: argparse.Namespace, settings) -> None:
    from registry.db import migrate, session_scope
    migrate(settings.db_url)
    try:
        with session_scope(settings.db_url) as s:
            if args.action == "create":
                print(set_admin_token(s, args.name, args.role))
            elif args.action == "revoke":
                revoke_admin_token(s, args.name)
                print(f"revoked admin token {args.name!r}")
            else:
                for t in list_admin_tokens(s):
                    state = f"revoked {t.revoked_at:%Y-%m-%d %H:%M}" if t.revoked_at else "active"
                    print(f"{t.name}\t{t.role}\t{state}\tcreated {t.created_at:%Y-%m-%d %H:%M}")
    except RegistryError as exc:
        raise SystemExit(f"fleet admin-token: {exc}") from exc
