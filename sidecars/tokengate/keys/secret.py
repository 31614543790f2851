"""The API keys themselves: a new key is ``tg-`` + 43 URL-safe random characters (256
bits), printed once; the configuration stores only its SHA-256 digest (the edge hashes
the bearer token it is given and looks the digest up)."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "tg-"


def new_key() -> str:
    """A new API key: ``tg-`` + 43 URL-safe characters (32 random bytes)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    """The SHA-256 hex digest the configuration stores for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()
