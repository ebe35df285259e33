"""The executable cache trusts only what proves itself (graph/cache.py, graph/trust.py): a forged
entry is never deserialized but recompiled and replaced, and ``cache verify`` calls it BAD; a
cache directory or key file that others could write or read is refused; what the cache creates
is private to its user whatever the umask."""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import os
import pickle
import re
import stat
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import serialize_executable

from tokenspeed_jax import cache as cache_cli
from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.compilers import engine_compiler
from tokenspeed_jax.graph import Call, ExecutableCache, Plan, PlanCompiler, Segment
from tokenspeed_jax.graph.cache import MAGIC, SUFFIX, decode
from tokenspeed_jax.graph.trust import KEY_BYTES, CacheTrustError, default_key_file, load_mac_key

WIDTH = 4
ROWS = (1, 2)  # one executable per bucket


def shift(params, x):
    return x * 2.0 + params


PLAN = Plan([Call(Segment("shift", shift, ("x",), ("x",)), jnp.ones(WIDTH))], ("x",), ("x",))


def compile_plan(cache: ExecutableCache):
    compiler = PlanCompiler(progress=False, cache=cache)
    for rows in ROWS:
        compiler.add(f"rows={rows}", PLAN, {"x": jax.ShapeDtypeStruct((rows, WIDTH), jnp.float32)})
    return compiler.compile_all()[1]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class Planted:
    """Unpickling it creates ``marker``: a stand-in for the code a forged entry would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def forged_entry(entry: bytes, payload: bytes, seal) -> bytes:
    """``entry`` with its payload replaced and its header kept (the payload's size updated), as
    someone who can write the cache directory could make it; ``seal(body)`` is the trailer."""
    header = decode(entry, load_mac_key())[0]
    head = json.dumps({**header, "payload_bytes": len(payload)}, sort_keys=True).encode()
    body = MAGIC + struct.pack("<Q", len(head)) + head + payload
    return body + seal(body)


SEALS = {
    "recomputed-sha256": lambda body: hashlib.sha256(body).digest(),
    "mac-of-another-key": lambda body: hmac.new(os.urandom(KEY_BYTES), body,
                                                hashlib.sha256).digest(),
}


@pytest.mark.parametrize("seal", SEALS.values(), ids=SEALS.keys())
def test_forged_entry_is_never_deserialized_but_recompiled_and_replaced(
        tmp_path, seal, monkeypatch, capsys, caplog):
    directory = tmp_path / "cache"
    compile_plan(ExecutableCache(directory, load_mac_key()))
    target = min(directory.glob(f"*{SUFFIX}"))
    marker = tmp_path / "planted-code-ran"
    payload = pickle.dumps(Planted(marker))
    forged = forged_entry(target.read_bytes(), payload, seal)
    target.write_bytes(forged)
    deserialized = []
    load = serialize_executable.deserialize_and_load
    monkeypatch.setattr(serialize_executable, "deserialize_and_load",
                        lambda data, *args, **kwargs: deserialized.append(data)
                        or load(data, *args, **kwargs))

    assert cache_cli.main(["verify", "--dir", str(directory)]) == 1
    report = capsys.readouterr().out
    assert f"{target.stem[:12]}" in report and "BAD: MAC mismatch" in report
    assert "1 ok, 1 bad" in report
    cache = ExecutableCache(directory, load_mac_key())
    summary = compile_plan(cache)

    assert not marker.exists()
    assert payload not in deserialized and len(deserialized) == 1  # the genuine entry only
    assert (summary.num_compiled, summary.num_loaded, cache.problems) == (1, 1, 1)
    assert f"{target.name} is unusable (MAC mismatch" in caplog.text
    replaced = target.read_bytes()
    assert replaced != forged and decode(replaced, load_mac_key())[1] != payload
    assert cache_cli.main(["verify", "--dir", str(directory)]) == 0
    assert not marker.exists()
    pickle.loads(payload)  # the planted payload was live: loading it would have run
    assert marker.exists()


def test_verify_without_a_key_verifies_nothing_deletes_nothing_and_creates_no_key(
        tmp_path, capsys):
    directory = tmp_path / "cache"
    compile_plan(ExecutableCache(directory, load_mac_key()))
    missing = tmp_path / "keys" / "cache.key"
    command = ["verify", "--dir", str(directory), "--key-file", str(missing), "--delete"]
    assert cache_cli.main(command) == 1
    report = capsys.readouterr().out
    assert f"no key file {missing}: no entry can be verified" in report
    assert "nothing is deleted" in report and f"0 ok, {len(ROWS)} bad" in report
    assert report.count("BAD: no MAC key") == len(ROWS)
    assert not missing.parent.exists()
    assert len(list(directory.glob(f"*{SUFFIX}"))) == len(ROWS)


@pytest.mark.parametrize("directory_mode", [0o777, 0o770, 0o702])
def test_a_cache_directory_others_may_write_is_refused(tmp_path, directory_mode, capsys):
    directory = tmp_path / "cache"
    directory.mkdir()
    directory.chmod(directory_mode)
    message = (rf"directory {re.escape(str(directory))} is writable by group or others "
               rf"\(mode 0o{directory_mode:03o}\).*run `chmod 700 {re.escape(str(directory))}`")
    with pytest.raises(CacheTrustError, match=message):
        ExecutableCache(directory, load_mac_key())
    assert cache_cli.main(["list", "--dir", str(directory)]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_engine_start_refuses_an_untrusted_cache_directory_naming_the_flags(tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir()
    directory.chmod(0o777)
    config = EngineConfig(compile_cache_dir=str(directory))
    with pytest.raises(CacheTrustError, match=r"chmod 700 .*--compile-cache-dir"):
        engine_compiler(config, description="compiling", fingerprint="", mesh=None)


def test_a_cache_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    owner = directory.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(CacheTrustError, match=rf"belongs to uid {owner}, not to this user "
                                              rf"\(uid {owner + 1}\)"):
        ExecutableCache(directory, None)


@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_a_fresh_cache_directory_and_key_are_private_whatever_the_umask(
        tmp_path, monkeypatch, umask):
    config_home = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    directory = tmp_path / "cache" / "executables"
    previous = os.umask(umask)
    try:
        key = load_mac_key()
        compile_plan(ExecutableCache(directory, key))
    finally:
        os.umask(previous)
    key_file = config_home / "tokenspeed_jax" / "cache.key"
    assert key_file.read_bytes() == key and len(key) == KEY_BYTES
    assert mode(key_file) == 0o600
    assert [mode(d) for d in (config_home, key_file.parent, directory.parent, directory)] \
        == [0o700] * 4
    assert [p.name for p in key_file.parent.iterdir()] == ["cache.key"]
    assert len(list(directory.glob(f"*{SUFFIX}"))) == len(ROWS)
    assert load_mac_key() == key  # the next start reads the same key


@pytest.mark.parametrize("key_mode", [0o644, 0o640, 0o620, 0o604, 0o700])
def test_a_key_file_others_may_read_or_write_is_refused(tmp_path, key_mode):
    key_file = tmp_path / "cache.key"
    key_file.write_bytes(os.urandom(KEY_BYTES))
    key_file.chmod(key_mode)
    if key_mode & 0o077:
        with pytest.raises(CacheTrustError, match=rf"\(mode 0o{key_mode:03o}\).*run `chmod 600 "
                                                  rf"{re.escape(str(key_file))}`"):
            load_mac_key(key_file)
    else:  # group and others: nothing
        assert load_mac_key(key_file) == key_file.read_bytes()
    key_file.chmod(0o600)
    assert load_mac_key(key_file) == key_file.read_bytes()


def test_a_key_file_of_another_length_or_user_is_refused(tmp_path, monkeypatch):
    key_file = tmp_path / "cache.key"
    key_file.write_bytes(os.urandom(16))
    key_file.chmod(0o600)
    with pytest.raises(CacheTrustError, match=f"holds 16 bytes, not {KEY_BYTES}: remove it"):
        load_mac_key(key_file)
    key_file.write_bytes(os.urandom(KEY_BYTES))
    owner = key_file.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(CacheTrustError, match=rf"key file .* belongs to uid {owner}"):
        load_mac_key(key_file)


def test_starts_creating_the_key_at_once_agree_on_one(tmp_path):
    key_file = tmp_path / "keys" / "cache.key"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda _: load_mac_key(key_file), range(8)))
    assert set(keys) == {key_file.read_bytes()}
    assert [p.name for p in key_file.parent.iterdir()] == ["cache.key"]  # no temporary files


def test_the_default_key_file_is_under_the_config_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert default_key_file() == str(tmp_path / "tokenspeed_jax" / "cache.key")
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_key_file() == str(tmp_path / ".config" / "tokenspeed_jax" / "cache.key")
    assert EngineConfig().compile_cache_key_file is None


def test_cli_list_shows_what_tells_apart_entries_of_one_bucket(tmp_path, capsys):
    """The same plan compiled with two XLA option sets: two entries per bucket, which the
    listing tells apart by their compiler options, and only by them."""
    directory = tmp_path / "cache"
    options = ({}, {"xla_cpu_enable_fast_math": True})
    for option_set in options:
        compiler = PlanCompiler(progress=False, cache=ExecutableCache(directory, load_mac_key()),
                                compiler_options=option_set)
        for rows in ROWS:
            compiler.add(f"rows={rows}", PLAN,
                         {"x": jax.ShapeDtypeStruct((rows, WIDTH), jnp.float32)})
        compiler.compile_all()
    assert cache_cli.main(["list", "--dir", str(directory)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if " shift " in line]
    assert len(rows) == 2 * len(ROWS)
    shown = sorted(re.search(r"\[(.*)\]$", line).group(1) for line in rows)
    expected = sorted(f"compiler_options={json.dumps(sorted(o.items()))}"
                      for o in options for _ in ROWS)
    assert shown == expected
