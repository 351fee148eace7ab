"""Which kernel-cache directories and libraries may be loaded from: ssh's rule for its own
files.

A library loaded from the cache runs as this process's user, so one that another user
wrote, or could have written, under the name build.py predicts would run their code as
ours. A cache directory is trusted when it is owned by this user and nobody else may
write it; every directory above it (its real path, links resolved) when it is owned by
this user or root and nobody else may write it, unless its sticky bit keeps others from
renaming what they do not own (``/tmp``). A library is trusted when it is a regular file
(not a link) owned by this user that nobody else may write. Since nobody else can write
a trusted directory, a trusted file stays what it was between the check and the load.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["make_private_directory", "untrusted_directory", "untrusted_library"]

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def untrusted_directory(path: Path) -> str | None:
    """Why the cache directory ``path`` is not to be trusted, or None."""
    me = os.geteuid()
    real = Path(os.path.realpath(path))
    for directory in [real, *real.parents]:
        info = os.stat(directory)
        is_cache = directory == real
        if info.st_uid != me and (is_cache or info.st_uid != 0):
            return f"{directory} is owned by {_owner_name(info.st_uid)}, not by this user"
        sticky = info.st_mode & stat.S_ISVTX and not is_cache
        if info.st_mode & _OTHERS_WRITE and not sticky:
            who = "group" if info.st_mode & stat.S_IWGRP else "others"
            return f"{directory} is writable by {who} (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def untrusted_library(path: Path) -> str | None:
    """Why the library file ``path`` is not to be trusted, or None."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    if info.st_uid != os.geteuid():
        return f"{path} is owned by {_owner_name(info.st_uid)}, not by this user"
    if info.st_mode & _OTHERS_WRITE:
        who = "group" if info.st_mode & stat.S_IWGRP else "others"
        return f"{path} is writable by {who} (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def make_private_directory(path: Path) -> None:
    """Create ``path`` and each missing directory above it, readable and writable by
    this user only (0700)."""
    missing = []
    for directory in [path, *path.parents]:
        if directory.exists():
            break
        missing.append(directory)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # another process made it meanwhile
            pass
