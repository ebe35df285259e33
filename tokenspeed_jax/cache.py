"""Inspect and manage the on-disk executable cache (``graph/cache.py``).

    python -m tokenspeed_jax.cache list   [--dir DIR]   # entries: segment, bucket, size, age
    python -m tokenspeed_jax.cache verify [--dir DIR] [--delete]   # checksums + compatibility
    python -m tokenspeed_jax.cache clear  [--dir DIR]

``--dir`` defaults to the directory the server uses by default. ``verify`` exits 1 when an entry
is corrupt or was built for another environment (``--delete`` removes those); ``list`` only
reads headers and never imports an executable.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tokenspeed_jax.graph.cache import EntryInfo, ExecutableCache, default_cache_dir


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
    parser.add_argument("--delete", action="store_true",
                        help="with verify: remove entries that fail")
    args = parser.parse_args(argv)
    cache = ExecutableCache(args.dir)
    if args.command == "clear":
        print(f"removed {cache.clear()} entries from {cache.directory}")
        return 0
    infos = list(cache.scan(verify=args.command == "verify"))
    print(f"{len(infos)} entries, {human_size(sum(i.size for i in infos))} in {cache.directory}")
    if infos:
        print(_title())
    bad = 0
    for info in infos:
        line = _row(info)
        if args.command == "verify":
            line += f"  {'ok' if info.problem is None else 'BAD: ' + info.problem}"
        elif info.problem is not None:
            line += f"  unreadable: {info.problem}"
        print(line)
        if info.problem is not None:
            bad += 1
            if args.command == "verify" and args.delete:
                info.path.unlink(missing_ok=True)
    if args.command == "verify":
        print(f"{len(infos) - bad} ok, {bad} bad" + (" (deleted)" if bad and args.delete else ""))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
