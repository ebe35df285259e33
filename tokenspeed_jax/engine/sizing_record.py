"""The KV page count a start sized from free memory, kept beside the executable cache.

The page count is part of every executable's shapes, so a count sized anew at each start from
free memory (which moves between starts) would miss the executable cache. ``num_kv_pages``
(``engine.py``) sizes it once, writes it here, and a later start of the same setup reads it back
and keeps it while it still fits. Invariants:

* A record is one JSON file ``kv-pages-<digest>.json`` in the cache directory. The digest hashes
  the record's key, everything but free memory that decides the count (the caller builds it:
  the model, page and reserved bytes, the settings that bound the count, the device's kind and
  total memory); the file holds the key too, and a read checks it.
* Data only: a record is parsed as JSON and validated (an object of this format with the same
  key and a positive integer count); anything else is ignored with a warning, and the caller's
  new count replaces it. A record can only propose a count: the caller still checks it against
  the memory free now and its bounds.
* Writes are atomic (``graph.cache.write_atomically``). A directory that cannot be made or
  trusted (``graph/trust.py``) or a file that cannot be read or written costs the record (a
  warning), never the start.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenspeed_jax.graph.cache import write_atomically
from tokenspeed_jax.graph.trust import CacheTrustError, make_private_directory

logger = logging.getLogger(__name__)

RECORD_FORMAT = 1  # bump when the record's fields change


def record_path(directory: str | Path, key: Mapping[str, Any]) -> Path:
    """Where the record of ``key`` lives in ``directory``."""
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()
    return Path(directory).expanduser() / f"kv-pages-{digest[:32]}.json"


def read_pages(directory: str | Path, key: Mapping[str, Any]) -> int | None:
    """The page count recorded for ``key``; None when there is none or it is unusable (a
    warning says why)."""
    path = record_path(directory, key)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning("ignoring the KV sizing record %s: %s", path, error)
        return None
    pages = record.get("num_pages") if isinstance(record, dict) else None
    if (not isinstance(record, dict) or record.get("format") != RECORD_FORMAT
            or record.get("key") != dict(key)
            or not isinstance(pages, int) or isinstance(pages, bool) or pages < 1):
        logger.warning("ignoring the KV sizing record %s: it is not a record of format %d for "
                       "this setup with a page count >= 1", path, RECORD_FORMAT)
        return None
    return pages


def write_pages(directory: str | Path, key: Mapping[str, Any], num_pages: int) -> Path | None:
    """Record ``num_pages`` for ``key``; the file written, or None (a warning says why)."""
    path = record_path(directory, key)
    record = {"format": RECORD_FORMAT, "key": dict(key), "num_pages": num_pages}
    try:
        make_private_directory(path.parent)
        write_atomically(path, json.dumps(record, sort_keys=True, indent=1).encode())
    except (OSError, CacheTrustError) as error:
        logger.warning("could not record the KV page count in %s: %s", path, error)
        return None
    return path
