"""On-disk cache of compiled executables: a restart loads them instead of compiling.

``PlanCompiler`` asks the cache for every executable before tracing it. A hit gives the
serialized executable and its output shapes, so a warm start neither traces, lowers nor compiles;
a miss is traced and compiled as usual, then written here.

**The key** is a SHA-256 over a description of everything that decides the program, built
without tracing (what ``executable_key`` hashes):

* the environment (``environment()``): cache format, jax and jaxlib versions, backend platform
  and its version string (the CUDA/driver build on a GPU), the device kind and count,
  ``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS``, and jax's trace-context settings (x64, default matmul
  precision, ...);
* the code: a hash of the package's modules that shape executables (``shapes_executables``:
  the ``models``, ``kernels``, ``graph`` and ``engine`` folders whole, less the engine's
  host-side modules, and the few top-level modules those import), plus the source file of the
  stage function when it lives anywhere else, and the function's module and qualified name.
  Editing any other module (the server, tokenizer, scheduler, CLIs) keeps every entry;
* what the function reads besides its arguments: the values of its closure cells when they are
  plain scalars or strings or tuples of them (shapes, dtype names), and otherwise the caller's
  ``fingerprint`` (the model runner passes the model's NNX graph definition, which holds every
  static attribute: config, dtypes, eps, in a form that is the same however the weights were
  made (``models.forward.structure_key``), the flax version, and ``classes_fingerprint`` of its
  own and the model's classes, so a method replaced at run time is a different key). A bound
  method or a closure over anything else is only cached when a fingerprint is given. Not seen:
  a module-level function replaced at run time (monkeypatched) without a source change; turn
  the cache off for such experiments;
* the call: stage name, donated argument positions, parameter and metadata tree structures, every
  argument's shape, dtype and weak type, and the XLA compiler options it is compiled with; for a
  program sharded over several devices, every argument's and output's ``NamedSharding`` (mesh axis
  names and sizes, the device ids in mesh order, the partition spec). A multi-device sharding of any
  other kind makes the executable uncacheable. Deserializing binds an executable to the device ids
  it was built for, which the key names, so a hit always runs on the same devices.

Hashing source files rather than the lowered program is what lets a warm start skip tracing; it
is sound as long as stage functions are deterministic in what the key names. jax's own
persistent compilation cache keys on the lowered program instead, so it must trace and lower
every time; it is neither used nor needed here.

**Entries** are files ``<key>.exe``: magic, a JSON header (segment, bucket, output shapes,
custom-call targets, the ids of the devices it runs on, versions, sizes, and the key's
description in compact form: each part of it, long ones as a short digest), the payload of
``jax.experimental.serialize_executable`` and an HMAC-SHA256 of all of it under the cache's MAC
key (``graph/trust.py``). Invariants:

* Writes are atomic: a temporary file in the cache directory, then ``os.replace``. Two processes
  writing one key both succeed and leave one whole entry; a reader never sees half a file.
* An entry is deserialized only after its MAC checks (``hmac.compare_digest``), and only from
  the bytes that were checked. A truncated, corrupted, forged or incompatible entry is detected
  (MAC, header, or a failed deserialize), logged, and reported as a miss; the caller recompiles
  and replaces it. Nothing in here raises into start-up except the ``ExecutableCache``
  constructor (a directory it must refuse, ``CacheTrustError`` below, or cannot create) and
  programming errors.
* A lookup that misses while entries of the same stage exist says why at INFO: which parts of
  the key's description (argument shapes, compiler options, package source hash, jax
  version, ...) differ from the closest such entry. It reads headers only, each file's once per
  ``ExecutableCache`` on its first such miss, so a start that hits every entry reads none; the
  headers it compares are not authenticated, so a tampered one can only mislead that message.
* Before an executable with custom calls (Pallas/Triton, Mosaic GPU, LAPACK) is deserialized,
  the modules that register those targets are imported; an entry whose known targets are still
  not registered is not loaded (it could crash the process) but recompiled. Targets of the
  caller's own FFI kernels are registered by the code that defines the stages, which runs
  before the plan is compiled.

**Trust.** The payload is a pickle: deserializing an entry runs whatever code it names, so an
entry is as trusted as whoever could have written it. What is trusted:

* the MAC key file, outside the cache directory (by default ``default_key_file()``:
  ``$XDG_CONFIG_HOME/tokenspeed_jax/cache.key``), 32 random bytes made 0600 on first use; an
  existing key file that others may read or write, that another user owns or that has another
  length is refused (``CacheTrustError``);
* the cache directory's owner: the directory is created 0700, and one that another user owns
  or that group or others may write is refused when the ``ExecutableCache`` is created.

Someone who can write the directory but cannot read the key (its permissions changed after
start-up, a shared or copied cache, a restored backup) cannot make this process run their
code: an entry they write or alter fails its MAC and is recompiled and replaced, never
deserialized, and since the MAC covers the header, which names the entry's key, they cannot
move a genuine entry to another key. They can still delete or damage entries (costing
recompiles), put back an older genuine entry of the same key (the same program, as far as the
key can tell) and fill the disk. Whoever can read the key can forge entries that run arbitrary
code in every process using it: keep it private to the user running the engine, and copy it
along with a cache only to where its readers are trusted as much. A key that is removed is
made anew on the next start; every entry then fails its MAC once and is recompiled. The
directories above the cache directory and the key file are not checked.

**Autotune results** (GPU) live in the subdirectory ``autotune/`` (0700), written and read by
XLA itself: protocol-buffer text naming the kernel configuration chosen for each fused
computation, not code, and not covered by the MAC. Someone who can write them can make a later
compile pick a slower configuration among those XLA accepts; ``clear`` removes them with the
entries.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import importlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable
from jax.sharding import NamedSharding

from tokenspeed_jax.graph.trust import make_private_directory

logger = logging.getLogger(__name__)

FORMAT = 5  # bump when the entry layout or the key description changes
MAGIC = b"TSJAXEXE"
SUFFIX = ".exe"
AUTOTUNE_SUBDIR = "autotune"  # XLA's autotune results, beside the entries
_MAC = 32  # HMAC-SHA256 trailer
_LENGTH = struct.Struct("<Q")
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# The package's code that can run while a stage is traced: these folders whole (a module added or
# moved anywhere inside one stays covered) and these top-level modules, less the engine's
# host-side modules (request bookkeeping and scheduling policy, never traced).
EXECUTABLE_FOLDERS = ("engine", "graph", "kernels", "models")
EXECUTABLE_MODULES = ("config.py", "parallel.py", "sampling_params.py",
                      "structured/bitmask.py", "structured/specs.py")
HOST_MODULES = ("engine/async_engine.py", "engine/block_manager.py", "engine/engine.py",
                "engine/request.py", "engine/scheduler.py", "engine/sizing_record.py",
                "engine/startup.py", "engine/state_slots.py")
_SIMPLE = (str, int, float, bool, type(None))
_DIGEST_ABOVE = 96  # a description part longer than this is kept in headers as a digest
# Readable names of the description's parts, for the message of a cache miss.
_PART_NAMES = {"package": "executable source hash", "function": "stage function or its model",
               "args": "argument shapes", "trees": "argument tree structure",
               "outputs": "output shardings", "compiler_options": "compiler options",
               "jax": "jax version", "jaxlib": "jaxlib version", "donate": "donated arguments"}
# Custom-call target prefix -> module whose import registers it (jax registers the rest at start).
_REGISTRARS = {
    "mosaic_gpu": "jax.experimental.mosaic.gpu",
    "triton_kernel_call": "jax._src.lib",
    "lapack_": "jax._src.lax.linalg",
}


class CacheEntryError(ValueError):
    """A cache entry is truncated, corrupted or cannot be loaded in this process."""


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/tokenspeed_jax/executables`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenspeed_jax", "executables")


# ----------------------------------------------------------------------------- the key


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shapes_executables(relative: PurePosixPath) -> bool:
    """Whether the package module at ``relative`` (a path under the package root) is code that
    can run while a stage is traced, and so belongs in every key."""
    if relative.as_posix() in HOST_MODULES:
        return False
    if relative.as_posix() in EXECUTABLE_MODULES:
        return True
    return len(relative.parts) > 1 and relative.parts[0] in EXECUTABLE_FOLDERS


def source_hash(root: Path) -> str:
    """SHA-256 over the path and contents of every module under ``root`` (a copy of the package)
    that ``shapes_executables``."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        relative = PurePosixPath(path.relative_to(root).as_posix())
        if shapes_executables(relative):
            digest.update(str(relative).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def package_source_hash() -> str:
    """``source_hash`` of this package."""
    return source_hash(_PACKAGE_ROOT)


def _plain(value: Any) -> bool:
    """A scalar, a string, or a tuple of such values (nested): something whose repr is its
    value in every process."""
    if isinstance(value, tuple):
        return all(map(_plain, value))
    return isinstance(value, _SIMPLE)


def _stable(value: Any) -> str:
    """A repr that is the same in every process (object addresses replaced by the type name)."""
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


@functools.cache
def environment() -> tuple[tuple[str, str], ...]:
    """The process-wide part of every key: versions, backend, devices, flags, jax settings."""
    device = jax.devices()[0]
    from jax._src import config as jax_config

    context = getattr(jax_config, "trace_context", lambda: ())()
    return (
        ("format", str(FORMAT)),
        ("jax", jax.__version__),
        ("jaxlib", jaxlib.__version__),
        ("platform", device.platform),
        ("platform_version", device.client.platform_version),
        ("device_kind", device.device_kind),
        ("device_count", str(jax.device_count())),
        ("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")),
        ("LIBTPU_INIT_ARGS", os.environ.get("LIBTPU_INIT_ARGS", "")),
        ("trace_context", ";".join(_stable(v) for v in context)),
        ("package", package_source_hash()),
    )


def function_identity(fn: Callable[..., Any], fingerprint: str | None) -> str | None:
    """What identifies ``fn``'s program besides its arguments, or None if that is unknowable.

    A module-level function (or one closing over plain scalars, strings and tuples of them) is
    identified by its module, qualified name, source file and closure values. A bound method or
    any other closure reads state the key cannot see: it is identified only together with the
    caller's ``fingerprint``.
    """
    target = getattr(fn, "__func__", fn)
    code = getattr(target, "__code__", None)
    if code is None:
        return None
    needs_fingerprint = hasattr(fn, "__self__")
    cells = []
    for cell in getattr(target, "__closure__", None) or ():
        value = cell.cell_contents
        if _plain(value):
            cells.append(repr(value))
        else:
            needs_fingerprint = True
    if needs_fingerprint and fingerprint is None:
        return None
    source = Path(code.co_filename).resolve()
    hashed = _PACKAGE_ROOT in source.parents and shapes_executables(
        PurePosixPath(source.relative_to(_PACKAGE_ROOT).as_posix()))
    code_hash = "package" if hashed else (_file_digest(source) if source.is_file() else None)
    if code_hash is None:
        return None
    return "\n".join([
        f"{target.__module__}.{target.__qualname__}", code_hash, ",".join(cells),
        fingerprint if needs_fingerprint else "",
    ])


def _code_digest(code: Any, digest: Any) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            _code_digest(const, digest)
        else:
            digest.update(_stable(const).encode())


def classes_fingerprint(classes: Sequence[type], *, skip_modules: Sequence[str] = ()) -> str:
    """A digest of the bytecode of every function defined on ``classes`` and their bases.

    Part of a caller's fingerprint: it changes when a method is edited *or replaced at run time*
    (a monkeypatched method has other bytecode), which the package source hash cannot see.
    Bases from modules starting with one of ``skip_modules`` (libraries whose version the caller
    includes instead) and ``builtins`` are skipped.
    """
    digest = hashlib.sha256()
    seen: set[type] = set()
    for cls in sorted({base for c in classes for base in c.__mro__}, key=lambda c: c.__qualname__):
        if cls in seen or cls.__module__.startswith(("builtins", *skip_modules)):
            continue
        seen.add(cls)
        digest.update(f"{cls.__module__}.{cls.__qualname__}".encode())
        for name, attribute in sorted(vars(cls).items()):
            target = getattr(attribute, "__func__", attribute)
            code = getattr(target, "__code__", None)
            if code is not None:
                digest.update(name.encode())
                _code_digest(code, digest)
    return digest.hexdigest()


def _sharding_key(sharding: Any) -> str | None:
    """A stable description of a multi-device NamedSharding; "" on one device; None: unknown."""
    if sharding is None or len(sharding.device_set) == 1:
        return ""
    if not isinstance(sharding, NamedSharding):
        return None
    mesh = sharding.mesh
    ids = [int(d.id) for d in mesh.devices.flat]
    return f"@{dict(mesh.shape)}{ids}{sharding.spec}{sharding.memory_kind or ''}"


def _spec_key(spec: Any) -> str | None:
    sharding = _sharding_key(getattr(spec, "sharding", None))
    if sharding is None:
        return None
    weak = getattr(spec, "weak_type", False)
    return f"{spec.dtype}{list(spec.shape)}{'w' if weak else ''}{sharding}"


@dataclasses.dataclass(frozen=True)
class ExecutableKey:
    """An executable's key: the digest that names its entry, and the parts of the description
    it hashes in compact form (``compact_parts``), kept in the entry's header."""

    digest: str
    parts: dict[str, Any]

    @property
    def stage(self) -> str:
        return self.parts["stage"]


def _compact(value: Any) -> Any:
    """``value`` as a header keeps it: itself when short, else a digest of its JSON."""
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) <= _DIGEST_ABOVE:
        return value
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def compact_parts(description: Mapping[str, Any]) -> dict[str, Any]:
    """The description's parts as headers keep them: the environment's items as parts of their
    own, each argument's spec as is (so a miss can name the argument), long parts digested."""
    parts = {name: _compact(value) for name, value in description["environment"]}
    for name, value in description.items():
        if name != "environment":
            parts[name] = [_compact(v) for v in value] if name == "args" else _compact(value)
    return parts


def executable_key(
    *,
    stage_name: str,
    identity: str | None,
    trees: Sequence[Any],
    args: Sequence[Any],
    donate: Sequence[int],
    out_shardings: Sequence[Any] | None = None,
    compiler_options: Mapping[str, str | bool] | None = None,
) -> ExecutableKey | None:
    """The cache key of one executable (see the module docstring), or None: not cacheable.
    ``out_shardings``: the explicit output shardings of a sharded program; ``compiler_options``:
    the XLA options it is compiled with."""
    specs = [_spec_key(a) for a in args]
    outputs = [_sharding_key(s) for s in out_shardings or ()]
    if identity is None or any(s is None for s in specs + outputs):
        return None
    description = {
        "environment": environment(),
        "stage": stage_name,
        "function": identity,
        "trees": [str(t) for t in trees],
        "args": specs,
        "donate": list(donate),
        "outputs": outputs,
        "compiler_options": sorted((compiler_options or {}).items()),
    }
    digest = hashlib.sha256(json.dumps(description).encode()).hexdigest()
    return ExecutableKey(digest, compact_parts(description))


def _part_difference(name: str, old: Any, new: Any) -> str:
    """One differing part of two descriptions, for a person: the part, and what changed when
    that is short enough to show."""
    label = _PART_NAMES.get(name, name)
    if name == "args" and isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return f"{label} ({len(old)} arguments -> {len(new)})"
        changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
        first = changed[0]
        return (f"{label} ({len(changed)} differ; argument {first}: {old[first]} -> "
                f"{new[first]})")
    if any(isinstance(v, str) and v.startswith("sha256:") for v in (old, new)):
        return label
    return f"{label} ({old!r} -> {new!r})"


def describe_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The parts in which two compact descriptions (``compact_parts``) differ, for a person."""
    return [_part_difference(name, old.get(name), new.get(name))
            for name in dict.fromkeys([*new, *old]) if old.get(name) != new.get(name)]


# ----------------------------------------------------------------------------- entries


@dataclasses.dataclass(frozen=True)
class Entry:
    """A verified cache entry: its header and the serialized executable."""

    path: Path
    header: dict[str, Any]
    payload: bytes
    out_specs: tuple[jax.ShapeDtypeStruct, ...]  # what the executable returns, from the header


@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """What ``scan`` reports per file: header (None when unreadable), size, age, problem."""

    path: Path
    header: dict[str, Any] | None
    size: int
    age_seconds: float
    problem: str | None


def _mac(mac_key: bytes | None, body: bytes) -> bytes:
    if mac_key is None:
        raise CacheEntryError("no MAC key: entries can be neither verified nor written")
    return hmac.new(mac_key, body, hashlib.sha256).digest()


def _encode(header: dict[str, Any], payload: bytes, mac_key: bytes | None) -> bytes:
    head = json.dumps(header, sort_keys=True).encode()
    body = MAGIC + _LENGTH.pack(len(head)) + head + payload
    return body + _mac(mac_key, body)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in its directory and ``os.replace``:
    a reader sees the old file or the whole new one, never part of it."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _read_header(data: bytes) -> tuple[dict[str, Any], int]:
    """(header, payload offset); CacheEntryError if the prefix is not a readable header."""
    if not data.startswith(MAGIC):
        raise CacheEntryError("bad magic (not a cache entry)")
    start = len(MAGIC) + _LENGTH.size
    if len(data) < start:
        raise CacheEntryError("truncated before the header")
    (length,) = _LENGTH.unpack_from(data, len(MAGIC))
    if len(data) < start + length:
        raise CacheEntryError(f"truncated inside the header ({len(data)} bytes)")
    try:
        header = json.loads(data[start:start + length])
    except ValueError as error:
        raise CacheEntryError(f"unreadable header: {error}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CacheEntryError(f"unknown entry format {header.get('format')!r}"
                              if isinstance(header, dict) else "header is not an object")
    return header, start + length


def read_header_only(path: Path) -> dict[str, Any]:
    """The header of the entry file at ``path``, reading no payload and checking no MAC;
    CacheEntryError (or OSError) when it cannot be read."""
    with path.open("rb") as file:
        prefix = file.read(len(MAGIC) + _LENGTH.size)
        if len(prefix) < len(MAGIC) + _LENGTH.size or not prefix.startswith(MAGIC):
            return _read_header(prefix)[0]  # raises: not an entry, or truncated
        (length,) = _LENGTH.unpack_from(prefix, len(MAGIC))
        return _read_header(prefix + file.read(length))[0]


def decode(data: bytes, mac_key: bytes | None) -> tuple[dict[str, Any], bytes]:
    """(header, payload) of an entry's bytes, authenticated with ``mac_key``; CacheEntryError
    when anything does not check (always, without a key)."""
    header, offset = _read_header(data)
    if len(data) < offset + _MAC:
        raise CacheEntryError(f"truncated ({len(data)} bytes)")
    body, mac = data[:-_MAC], data[-_MAC:]
    if not hmac.compare_digest(_mac(mac_key, body), mac):
        raise CacheEntryError("MAC mismatch (corrupted, forged, or written with another key)")
    payload = body[offset:]
    if len(payload) != header.get("payload_bytes"):
        raise CacheEntryError(f"payload is {len(payload)} bytes, header says "
                              f"{header.get('payload_bytes')}")
    return header, payload


def custom_call_targets(compiled: jax.stages.Compiled) -> list[str]:
    """The custom-call targets (kernels registered by name) an executable calls."""
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text() or "")))


def register_custom_calls(targets: Sequence[str]) -> list[str]:
    """Import the modules that register ``targets`` (kernels jax registers on import of a module,
    not at start-up); return those of them still unregistered. Targets XLA implements itself
    (``TopK``, ...) or that no known module registers are the caller's to register."""
    known = [t for t in targets if any(t.startswith(p) for p in _REGISTRARS)]
    if not known:
        return []
    for prefix, module in _REGISTRARS.items():
        if any(t.startswith(prefix) for t in known):
            importlib.import_module(module)
    from jax._src.lib import xla_client

    listing = getattr(xla_client, "custom_call_targets", None)
    if listing is None:  # this jaxlib cannot list targets: the imports above are all we can do
        return []
    registered = listing(jax.devices()[0].client.platform)
    return [t for t in known if t not in registered]


class ExecutableCache:
    """A directory of serialized executables keyed by ``executable_key`` (module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], mac_key: bytes | None) -> None:
        """Create ``directory`` (0700) if missing; ``CacheTrustError`` when it exists but
        another user owns it or group or others may write it. ``mac_key``: authenticates
        entries (``graph/trust.py``'s ``load_mac_key``); None only to list and clear entries,
        none of which then verifies or can be written."""
        self.directory = Path(directory).expanduser()
        make_private_directory(self.directory)
        self._mac_key = mac_key
        self.problems = 0  # entries found corrupt, forged or unloadable in this process
        self._stage_headers: dict[str, list[tuple[Path, dict[str, Any]]]] | None = None

    def path(self, digest: str) -> Path:
        return self.directory / f"{digest}{SUFFIX}"

    def autotune_directory(self) -> str:
        """The directory (0700, created if missing) where XLA keeps the kernel choices its GPU
        autotuner measured (``PlanCompiler(autotune_cache_dir=...)``), beside the entries."""
        directory = self.directory / AUTOTUNE_SUBDIR
        make_private_directory(directory)
        return str(directory)

    def _problem(self, path: Path, reason: str) -> None:
        self.problems += 1
        logger.warning("compile cache entry %s is unusable (%s): recompiling and replacing it",
                       path.name, reason)

    def get(self, key: ExecutableKey, *, label: str = "") -> Entry | None:
        """The verified entry of ``key``; None when absent (why, at INFO, when entries of the
        same stage exist; ``label`` names the bucket there) or unusable (logged)."""
        path = self.path(key.digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._explain_miss(key, label)
            return None
        except OSError as error:
            self._problem(path, f"unreadable: {error}")
            return None
        try:
            header, payload = decode(data, self._mac_key)
            if header.get("key") != key.digest:
                raise CacheEntryError(f"entry holds key {header.get('key')!r}")
            out_specs = tuple(jax.ShapeDtypeStruct(tuple(shape), dtype, weak_type=weak)
                              for shape, dtype, weak in header["out_specs"])
        except (CacheEntryError, KeyError, TypeError, ValueError) as error:
            self._problem(path, str(error))
            return None
        return Entry(path, header, payload, out_specs)

    def _explain_miss(self, key: ExecutableKey, label: str) -> None:
        """Log which parts of ``key``'s description differ from the closest entry of its stage
        (module docstring); nothing when there is none."""
        if self._stage_headers is None:
            self._stage_headers = {}
            for path in self.files():
                try:
                    header = read_header_only(path)
                except (OSError, CacheEntryError):
                    continue  # unreadable entries are reported when they are looked up
                if isinstance(header.get("description"), dict):
                    self._stage_headers.setdefault(header.get("segment"), []).append(
                        (path, header))
        candidates = [(describe_difference(header["description"], key.parts), path, header)
                      for path, header in self._stage_headers.get(key.stage, ())]
        if not candidates:
            return
        differences, path, header = min(reversed(candidates), key=lambda c: len(c[0]))  # newest
        logger.info("compile cache miss for %s @ %s: the closest of %d cached %r entries (%s, "
                    "bucket %s) differs in %s", key.stage, label or "?", len(candidates),
                    key.stage, path.name[:12], header.get("bucket"), "; ".join(differences))

    def load(self, entry: Entry) -> jax.stages.Compiled:
        """Deserialize ``entry`` onto this backend; CacheEntryError (logged) when it cannot."""
        header = entry.header
        try:
            missing = register_custom_calls(header["custom_calls"])
            if missing:
                raise CacheEntryError(f"custom-call targets {missing} are not registered")
            num_args, num_outputs = header["num_args"], len(header["out_specs"])
            in_tree = jax.tree_util.tree_structure((tuple(range(num_args)), {}))
            out_tree = jax.tree_util.tree_structure(tuple(range(num_outputs)))
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in header["devices"]]
            return serialize_executable.deserialize_and_load(entry.payload, in_tree, out_tree,
                                                             execution_devices=devices)
        except Exception as error:
            self._problem(entry.path, f"cannot be loaded: {type(error).__name__}: {error}")
            raise CacheEntryError(str(error)) from error

    def put(
        self,
        key: ExecutableKey,
        compiled: jax.stages.Compiled,
        *,
        segment: str,
        bucket: str,
        out_specs: Sequence[Any],
        compile_seconds: float,
    ) -> bool:
        """Serialize ``compiled`` under ``key`` atomically; False (logged) if it cannot be."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            header = {
                "format": FORMAT,
                "key": key.digest,
                "description": key.parts,
                "segment": segment,
                "bucket": bucket,
                "num_args": in_tree.num_leaves,
                "out_specs": [[list(s.shape), str(s.dtype), bool(getattr(s, "weak_type", False))]
                              for s in out_specs],
                "custom_calls": custom_call_targets(compiled),
                # the executable's devices in assignment order: it must be loaded onto these
                "devices": [d.id for d in compiled.runtime_executable().local_devices()],
                "jax": jax.__version__,
                "jaxlib": jaxlib.__version__,
                "platform": jax.devices()[0].platform,
                "device_kind": jax.devices()[0].device_kind,
                "compile_seconds": round(compile_seconds, 4),
                "created": time.time(),
                "payload_bytes": len(payload),
            }
            if out_tree.num_leaves != len(out_specs):
                raise ValueError(f"{out_tree.num_leaves} outputs, {len(out_specs)} specs")
            write_atomically(self.path(key.digest), _encode(header, payload, self._mac_key))
        except Exception as error:  # noqa: BLE001 - a failed write must not stop start-up
            logger.warning("could not cache executable %s @ %s: %s: %s", segment, bucket,
                           type(error).__name__, error)
            return False
        return True

    def files(self) -> list[Path]:
        """Entry files, oldest first (temporary files of unfinished writes excluded)."""
        if not self.directory.is_dir():
            return []
        paths = [p for p in self.directory.glob(f"*{SUFFIX}") if not p.name.startswith(".")]
        return sorted(paths, key=lambda p: p.stat().st_mtime)

    def scan(self, *, verify: bool = False) -> Iterator[EntryInfo]:
        """Every entry with its header; ``verify`` also checks the MAC and that this process
        (jax/jaxlib version, platform, device kind) could load it. Nothing is deserialized."""
        now = time.time()
        for path in self.files():
            try:
                data = path.read_bytes()
                stat = path.stat()
            except OSError:
                continue  # removed while scanning
            header, problem = None, None
            try:
                header = (decode(data, self._mac_key) if verify else _read_header(data))[0]
                if verify:
                    problem = _incompatibility(header)
            except CacheEntryError as error:
                problem = str(error)
            yield EntryInfo(path, header, stat.st_size, now - stat.st_mtime, problem)

    def clear(self) -> int:
        """Remove every entry, leftover temporary file and the autotune results; the number of
        entries removed."""
        removed = 0
        if self.directory.is_dir():
            for path in self.directory.glob(f"*{SUFFIX}"):
                path.unlink(missing_ok=True)
                removed += not path.name.startswith(".")
            shutil.rmtree(self.directory / AUTOTUNE_SUBDIR, ignore_errors=True)
        return removed


def _incompatibility(header: dict[str, Any]) -> str | None:
    device = jax.devices()[0]
    current = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
               "platform": device.platform, "device_kind": device.device_kind}
    stale = [f"{k} {header.get(k)!r} != {v!r}" for k, v in current.items() if header.get(k) != v]
    return f"built for another environment: {', '.join(stale)}" if stale else None
