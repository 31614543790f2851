"""Admin passwords: a salted ``hashlib.scrypt`` digest with its parameters in the string,
``scrypt$n=32768,r=8,p=3$<salt>$<key>`` (salt 16 random bytes, key 32 bytes, both in
unpadded URL-safe base64), what ``ledger.console.admins`` holds.

Parameters: N = 2^15, r = 8, p = 3, one of the equivalent settings OWASP's Password
Storage Cheat Sheet lists for scrypt (32 MiB of memory, about 0.3 s of one core here).
A digest written with other parameters is checked with its own, so they can be raised
later without invalidating a password.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import secrets
import string
import threading

from tokengate.config.console import SCRYPT_DIGEST

N, R, P = 2**15, 8, 3
SALT_BYTES = 16
KEY_BYTES = 32
MIN_LENGTH = 10       # characters of a password `tokengate console passwd` accepts
MAX_LENGTH = 1024     # longer input is refused before it is hashed

# one scrypt at a time in a process: each holds 128 * r * N bytes (32 MiB) while it runs
_one_at_a_time = threading.Lock()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int, dklen: int) -> bytes:
    with _one_at_a_time:
        return hashlib.scrypt(password.encode(), salt=salt, n=n, r=r, p=p,
                              maxmem=256 * r * n + 2**20, dklen=dklen)


def digest(password: str, salt: bytes | None = None, n: int = N) -> str:
    """The digest of ``password`` with a fresh random salt (or ``salt``) at scrypt's
    cost ``n`` (a power of two; default ``N``, what `tokengate console passwd` writes; the
    tests' admins use 2**10, 1/32 of the time: a login costs what its digest says)."""
    salt = salt if salt is not None else secrets.token_bytes(SALT_BYTES)
    key = _scrypt(password, salt, n, R, P, KEY_BYTES)
    return f"scrypt$n={n},r={R},p={P}${_b64(salt)}${_b64(key)}"


def verify(password: str, stored: str) -> bool:
    """Whether ``password`` matches the digest ``stored`` (compared in constant time).
    A malformed digest or an overlong password never matches."""
    m = SCRYPT_DIGEST.fullmatch(stored)
    if m is None or len(password) > MAX_LENGTH:
        return False
    try:
        salt, key = _unb64(m["salt"]), _unb64(m["key"])
        got = _scrypt(password, salt, int(m["n"]), int(m["r"]), int(m["p"]), len(key))
    except ValueError:
        return False
    return hmac.compare_digest(got, key)


@functools.cache
def _dummy() -> str:
    """A real digest of no password anyone knows (made on first use): a login of an
    unknown name costs the same time as one of a known name, so the answer's delay does
    not tell names apart."""
    return digest(secrets.token_urlsafe(32))


def verify_admin(admins: dict[str, str], name: str, password: str) -> bool:
    """Whether ``name`` is an admin of ``admins`` and ``password`` is theirs; an unknown
    name is checked against a dummy digest (same cost)."""
    stored = admins.get(name)
    ok = verify(password, stored if stored is not None else _dummy())
    return ok and stored is not None


def new_password() -> str:
    """A generated password: 16 letters and digits (95 random bits), easy to paste."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(16))


def check_new(password: str) -> str | None:
    """Why ``password`` may not be set (None: it may)."""
    if len(password) < MIN_LENGTH:
        return f"a password has at least {MIN_LENGTH} characters"
    if len(password) > MAX_LENGTH:
        return f"a password has at most {MAX_LENGTH} characters"
    if password != password.strip():
        return "a password neither starts nor ends with white space"
    return None
