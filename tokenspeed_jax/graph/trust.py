"""What the executable cache trusts: its MAC key file and its directory (``graph/cache.py``
explains the trust model).

Invariants:

* The MAC key is ``KEY_BYTES`` random bytes in a regular file that belongs to the user running
  this process and that only this user may read or write (mode 0600). An existing key file that
  breaks any of this is refused with ``CacheTrustError``, whose message says how to fix it; it
  is never repaired silently.
* A missing key file is created, when asked, atomically: written 0600 under a temporary name,
  then hard-linked into place. Two processes starting at once use the one key the first link
  wrote; no reader sees a partial key.
* Directories made here (a cache directory, a key file's directory, their missing parents) are
  created 0700 whatever the umask. A directory the cache uses or writes a key into must belong
  to this user and must not be writable by group or others; otherwise ``CacheTrustError``.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

KEY_BYTES = 32  # an HMAC-SHA256 key as long as the digest
_REMOVE_KEY = ("remove it and a new key is made on the next start (every cache entry is then "
               "recompiled once)")


class CacheTrustError(ValueError):
    """A cache directory or key file is not private to this user; the message says the fix."""


def default_key_file() -> str:
    """``$XDG_CONFIG_HOME/tokenspeed_jax/cache.key`` (``~/.config/...`` when unset): outside the
    cache directory, which may be cleared, copied or shared without the key."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "tokenspeed_jax", "cache.key")


def check_directory(path: Path) -> None:
    """Refuse (``CacheTrustError``) ``path`` unless it is a directory of this user that group
    and others cannot write."""
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise CacheTrustError(f"{path} is not a directory")
    if info.st_uid != os.geteuid():
        raise CacheTrustError(
            f"directory {path} belongs to uid {info.st_uid}, not to this user (uid "
            f"{os.geteuid()}): its owner could tamper with the compiled executables this "
            f"process runs; use a directory of your own")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise CacheTrustError(
            f"directory {path} is writable by group or others (mode 0o{mode:03o}): they could "
            f"tamper with the compiled executables this process runs; run `chmod 700 {path}` "
            f"or use a directory of your own")


def make_private_directory(path: Path) -> None:
    """Create ``path`` and its missing parents 0700; then ``check_directory(path)``."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:  # made by a concurrent start: checked below like any other
            continue
        directory.chmod(0o700)  # mkdir's mode is masked by the umask
    check_directory(path)


def load_mac_key(key_file: str | os.PathLike[str] | None = None, *,
                 create: bool = True) -> bytes | None:
    """The MAC key in ``key_file`` (None: ``default_key_file()``). A missing file is created
    when ``create``, else the answer is None. ``CacheTrustError`` when the file is refused."""
    path = Path(key_file or default_key_file()).expanduser()
    try:
        return _read_key(path)
    except FileNotFoundError:
        if not create:
            return None
    _create_key(path)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    with open(path, "rb") as file:
        info = os.fstat(file.fileno())  # of the file opened, wherever a symlink pointed
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISREG(info.st_mode):
            raise CacheTrustError(f"key file {path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise CacheTrustError(
                f"key file {path} belongs to uid {info.st_uid}, not to this user (uid "
                f"{os.geteuid()}): its owner can forge cache entries that run code in this "
                f"process; use a key file of your own, or {_REMOVE_KEY}")
        if mode & 0o077:
            raise CacheTrustError(
                f"key file {path} is open to group or others (mode 0o{mode:03o}): whoever reads "
                f"it can forge cache entries that run code in this process; run "
                f"`chmod 600 {path}`, or, if others may have read it, {_REMOVE_KEY}")
        key = file.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise CacheTrustError(
            f"key file {path} holds {len(key)} bytes, not {KEY_BYTES}: {_REMOVE_KEY}")
    return key


def _create_key(path: Path) -> None:
    make_private_directory(path.parent)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".key")
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), 0o600)  # mkstemp's 0600 is masked by the umask
            file.write(secrets.token_bytes(KEY_BYTES))
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            return  # a concurrent start made one first: that is the key
        logger.info("created the executable cache's MAC key %s", path)
    finally:
        os.unlink(temp)
