"""Inspect and manage the on-disk executable cache (``graph/cache.py``).

    python -m tokenspeed_jax.cache list   [--dir DIR]   # entries: segment, bucket, size, age
                                                        # and what tells apart entries of one
                                                        # segment and bucket
    python -m tokenspeed_jax.cache verify [--dir DIR] [--key-file FILE] [--delete]
                                                        # MACs + compatibility
    python -m tokenspeed_jax.cache clear  [--dir DIR]

``--dir`` and ``--key-file`` default to what the server uses by default. ``verify`` checks every
entry's MAC with the key the server uses and exits 1 when an entry is corrupt, forged or was
built for another environment (``--delete`` removes those); it never creates a key, so without
one no entry verifies (and none is deleted). ``list`` only reads headers. No command
deserializes an executable. A cache directory or key file the server would refuse
(``graph/trust.py``) is refused here too (exit 2).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from tokenspeed_jax.graph.cache import EntryInfo, ExecutableCache, default_cache_dir
from tokenspeed_jax.graph.trust import CacheTrustError, default_key_file, load_mac_key


def human_size(size: int) -> str:
    """Bytes as B / KiB / MiB / GiB with one decimal above bytes."""
    value = float(size)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def human_age(seconds: float) -> str:
    """An age as whole seconds, minutes, hours or days."""
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{int(seconds // length)}{unit}"
    return f"{int(seconds)}s"


SHOWN_CHARS = 40  # a key part's value longer than this is shown as a short digest


def _shown(value: object) -> str:
    """A key part's value for a listing: as JSON when short, else an 8-digit digest of it."""
    if isinstance(value, str) and value.startswith("sha256:"):
        return "#" + value.removeprefix("sha256:")[:8]
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= SHOWN_CHARS else "#" + hashlib.sha256(text.encode()).hexdigest()[:8]


def distinguishing(infos: Sequence[EntryInfo]) -> dict[Path, str]:
    """For entries that share a segment and a bucket: the parts of their keys' descriptions that
    differ within that group, as ``part=value`` of each entry (entries alone in their group, or
    without a readable description, get nothing)."""
    groups: dict[tuple, list[tuple[Path, dict]]] = defaultdict(list)
    for info in infos:
        header = info.header or {}
        if isinstance(header.get("description"), dict):
            groups[header.get("segment"), header.get("bucket")].append(
                (info.path, header["description"]))
    shown = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        names = dict.fromkeys(name for _, description in group for name in description)
        differing = [name for name in names
                     if len({_shown(d.get(name)) for _, d in group}) > 1]
        for path, description in group:
            shown[path] = " ".join(f"{name}={_shown(description.get(name))}"
                                   for name in differing)
    return shown


def _row(info: EntryInfo) -> str:
    header = info.header or {}
    return (f"{info.path.stem[:12]:<12}  {header.get('segment', '?'):<14} "
            f"{header.get('bucket', '?'):<22} {human_size(info.size):>10} "
            f"{human_age(info.age_seconds):>5}  {header.get('platform', '?')}")


def _title() -> str:
    return f"{'key':<12}  {'segment':<14} {'bucket':<22} {'size':>10} {'age':>5}  platform"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenspeed_jax.cache",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("list", "verify", "clear"))
    parser.add_argument("--dir", default=default_cache_dir(), help="cache directory")
    parser.add_argument("--key-file", default=default_key_file(),
                        help="with verify: the MAC key file the server uses")
    parser.add_argument("--delete", action="store_true",
                        help="with verify: remove entries that fail")
    args = parser.parse_args(argv)
    directory = Path(args.dir).expanduser()
    if not directory.is_dir():
        print(f"no cache directory {directory}")
        return 0
    try:
        mac_key = load_mac_key(args.key_file, create=False) if args.command == "verify" else None
        cache = ExecutableCache(directory, mac_key)
    except CacheTrustError as error:
        print(f"refused: {error}", file=sys.stderr)
        return 2
    delete = args.command == "verify" and args.delete
    if args.command == "verify" and mac_key is None:
        print(f"no key file {args.key_file}: no entry can be verified (the first start that uses "
              f"the cache creates one){'; nothing is deleted' if delete else ''}")
        delete = False
    if args.command == "clear":
        print(f"removed {cache.clear()} entries from {cache.directory}")
        return 0
    infos = list(cache.scan(verify=args.command == "verify"))
    print(f"{len(infos)} entries, {human_size(sum(i.size for i in infos))} in {cache.directory}")
    if infos:
        print(_title())
    bad = 0
    apart = distinguishing(infos)
    for info in infos:
        line = _row(info)
        if info.path in apart:
            line += f"  [{apart[info.path]}]"
        if args.command == "verify":
            line += f"  {'ok' if info.problem is None else 'BAD: ' + info.problem}"
        elif info.problem is not None:
            line += f"  unreadable: {info.problem}"
        print(line)
        if info.problem is not None:
            bad += 1
            if delete:
                info.path.unlink(missing_ok=True)
    if args.command == "verify":
        print(f"{len(infos) - bad} ok, {bad} bad" + (" (deleted)" if bad and delete else ""))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
