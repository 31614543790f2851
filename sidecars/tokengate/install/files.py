"""The file operations of an install: folders and files with their mode and owner, files
written atomically, the commands it runs."""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


def ids(user: str, group: str, stand_in: bool) -> tuple[int, int]:
    """uid and gid; with ``stand_in`` root replaces a user that does not exist."""
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        if not stand_in:
            raise
        uid = 0
    return uid, grp.getgrnam(group).gr_gid


def chown(path: Path, user: str, group: str, stand_in: bool) -> None:
    # Only root may give files away; a non-root prefix install keeps its own ids.
    if os.geteuid() == 0:
        os.chown(path, *ids(user, group, stand_in))


def write(path: Path, data: bytes, mode: int, owner: tuple[str, str] | None,
           stand_in: bool) -> None:
    """Write atomically (a rename in the same folder): nginx reloading meanwhile reads
    the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        if owner is not None:
            chown(Path(tmp), *owner, stand_in)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fix_mode(path: Path, mode: int, owner: tuple[str, str], stand_in: bool) -> None:
    """Set ``path``'s mode and owner (a file kept from an earlier install)."""
    os.chmod(path, mode)
    chown(path, *owner, stand_in)


def owner_name(uid: int, gid: int) -> str:
    """``user:group`` of the ids (the numbers where no name exists)."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return f"{user}:{group}"


def run(argv: list[str]) -> None:
    subprocess.run(argv, check=True)


def bind(fn: Callable[..., None], *args: object) -> Callable[[], None]:
    return lambda: fn(*args)


def make_dir(path: Path, mode: int, owner: tuple[str, str] | None, stand_in: bool) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        os.chmod(path, mode)
        chown(path, *owner, stand_in)
