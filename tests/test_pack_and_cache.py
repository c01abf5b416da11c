"""The weight pack is verified like the library (checksums, verified once and recorded), and the
cache survives what the file system does: held or stale locks, read-only roots, a full disk,
symlinked entries, an empty root variable.  Every test works on copies of the session's build.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from paged_decode.cli import cache_cmd
from paged_decode.compile import api, cache
from paged_decode.runtime import pack as pack_mod
from paged_decode.runtime.artifact import load_artifact, load_weights
from paged_decode.runtime.errors import (ArtifactError, ConfigError, LockTimeoutError,
                                         WeightsError)

from .conftest import BATCHED
from .test_artifact_verify import _prepare, built, compiles, root  # noqa: F401 (fixtures)


def _pack(root: Path) -> Path:
    (pack,) = (root / "weights").iterdir()
    return pack


def _flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


PACK_DAMAGE = {
    "params_byte_flipped": (lambda p: _flip(p / "params.safetensors"),
                            r"params\.safetensors is missing or damaged \(its sha256 differs "
                            r"from the pack's record"),
    "params_truncated": (lambda p: os.truncate(p / "params.safetensors", 1000),
                         r"params\.safetensors is missing or damaged \(header of \d+ bytes "
                         r"in a file of 1000\)"),
    "params_data_cut": (lambda p: os.truncate(p / "params.safetensors",
                                              (p / "params.safetensors").stat().st_size - 4),
                        r"params\.safetensors is missing or damaged \(.*data bytes\)"),
    "params_deleted": (lambda p: (p / "params.safetensors").unlink(),
                       r"params\.safetensors is missing or damaged \(\[Errno 2\]"),
    "params_appended": (lambda p: open(p / "params.safetensors", "ab").write(b"\0" * 8),
                        r"params\.safetensors is missing or damaged \(\d+ bytes, the pack "
                        r"recorded \d+: truncated or replaced\)"),
    "tokenizer_damaged": (lambda p: _flip(p / "tokenizer.json", 0.9),
                          r"tokenizer\.json is missing or damaged \(its sha256 differs"),
    "tokenizer_meta_deleted": (lambda p: (p / "tokenizer_meta.json").unlink(),
                               r"tokenizer_meta\.json is missing or damaged"),
    "checksums_removed": (lambda p: _edit_meta(p, lambda m: m.pop("files")),
                          r"weights\.json lists no file checksums"),
    # weights.json's own fields are covered by its meta_sha256, checked at every load (the
    # files' stats vouch for the files only)
    "shape_key_edited": (lambda p: _edit_meta(p, lambda m: m.update(shape_key="0" * 16)),
                         r"weights\.json does not match its checksum \(a field was edited"),
    "weights_key_edited": (lambda p: _edit_meta(p, lambda m: m.update(weights_key="0" * 16)),
                           r"weights\.json does not match its checksum"),
    "meta_checksum_removed": (lambda p: _edit_meta(p, lambda m: m.pop("meta_sha256")),
                              r"weights\.json lacks its checksum \(meta_sha256\)"),
}


def _edit_meta(pack: Path, edit) -> None:
    meta = json.loads((pack / "weights.json").read_text())
    edit(meta)
    (pack / "weights.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", PACK_DAMAGE, ids=list(PACK_DAMAGE))
def test_a_damaged_pack_is_refused_then_rebuilt_under_on(damage, root, compiles, built):
    edit, reason = PACK_DAMAGE[damage]
    pack = _pack(root)
    edit(pack)
    artifact = load_artifact(root / built.artifact_dir.name)
    with pytest.raises(WeightsError, match=reason) as info:
        load_weights(pack, artifact)
    assert re.search(r"`paged-compile --model tiny --weight-dtype float32 --artifacts \S+ "
                     r"--force`", str(info.value)), str(info.value)
    prepared = _prepare(root, policy="on")
    assert prepared.cache_hit and not prepared.weights_cache_hit and compiles == []
    weights = load_weights(prepared.weights_dir, artifact)
    fresh = load_weights(built.weights_dir, artifact)
    for got, want in zip(weights.params, fresh.params):
        assert bytes(memoryview(got.numpy())) == bytes(memoryview(want.numpy()))


def test_force_rebuilds_the_pack_too(root, compiles):
    pack = _pack(root)
    (pack / "marker").write_text("old pack")
    prepared = _prepare(root, force=True)
    assert not prepared.cache_hit and not prepared.weights_cache_hit
    assert prepared.weights_dir == pack and not (pack / "marker").exists()


def test_a_verified_pack_is_hashed_once_until_a_file_changes(root, built, monkeypatch):
    """The build records the stats it verified; loading then hashes nothing, and any write to a
    file (its ctime moves, even with the mtime put back) makes the next load hash again."""
    pack, artifact = _pack(root), load_artifact(root / built.artifact_dir.name)
    hashed = []
    real = pack_mod.tree_sha256
    monkeypatch.setattr(pack_mod, "tree_sha256", lambda p, *a: hashed.append(p.name) or real(p))
    load_weights(pack, artifact)
    load_weights(pack, artifact)
    # the copy in this root has new inodes: one verification, then the stats vouch
    assert sorted(hashed) == sorted(json.loads((pack / "weights.json").read_text())["files"])
    hashed.clear()
    load_weights(pack, artifact)
    assert hashed == []
    params = pack / "params.safetensors"
    st = params.stat()
    time.sleep(0.01)
    params.write_bytes(params.read_bytes())  # same bytes, a write all the same
    os.utime(params, ns=(st.st_atime_ns, st.st_mtime_ns))
    load_weights(pack, artifact)
    assert hashed == ["params.safetensors"]


def test_a_checkpoint_pack_hint_names_the_folder_as_given(build, llama_ckpt, tmp_path):
    """A damaged pack of an HF folder names that folder's full path as ``--model`` (its base
    name, the model's name, is nothing ``--model`` resolves)."""
    import shlex

    built = build(llama_ckpt.path, **BATCHED)
    pack = Path(shutil.copytree(built.weights_dir, tmp_path / "weights" / "pack"))
    _flip(pack / "params.safetensors")
    path = shlex.quote(str(Path(llama_ckpt.path).resolve()))
    with pytest.raises(WeightsError, match=re.escape(f"paged-compile --model {path} ")):
        load_weights(pack, load_artifact(built.artifact_dir))


# -- locks -----------------------------------------------------------------------------------

def _hold(root: Path, name: str, note: str):
    """Take ``name``'s build lock as another process would (flock locks per open file)."""
    (root / ".locks").mkdir(exist_ok=True)
    fh = open(root / ".locks" / f"{name}.lock", "a+")
    fcntl.flock(fh, fcntl.LOCK_EX)
    fh.seek(0)
    fh.truncate()
    fh.write(note)
    fh.flush()
    return fh


def test_a_complete_entry_loads_while_its_lock_is_held(root, compiles, built):
    held = _hold(root, built.artifact_dir.name, "pid 999999 since then")
    try:
        prepared = _prepare(root, policy="on", lock_timeout=0)
    finally:
        held.close()
    assert prepared.cache_hit and prepared.weights_cache_hit and compiles == []


def test_a_waiter_says_whom_it_waits_for_and_gives_up(root, compiles, built):
    said = []
    held = _hold(root, built.artifact_dir.name, "pid 4242 since 12:00:00")
    try:
        t0 = time.monotonic()
        with pytest.raises(LockTimeoutError, match=r"pid 4242 since 12:00:00 has held the build "
                           r"lock of .* for over 0\.3 s; .* --lock-timeout"):
            _prepare(root, policy="redo", lock_timeout=0.3, progress=said.append)
        assert time.monotonic() - t0 < 5
    finally:
        held.close()
    assert any(re.match(r"waiting for pid 4242 since 12:00:00, which is building ", s)
               for s in said), said
    assert compiles == []
    assert _prepare(root, policy="redo").cache_hit is False  # released: builds again


@pytest.mark.parametrize("bad", [-1, "soon", float("nan")])
def test_a_bad_lock_timeout_is_a_config_error(root, bad):
    with pytest.raises(ConfigError, match=r"lock_timeout=.*must be a number of seconds >= 0"):
        _prepare(root, lock_timeout=bad)


# -- the file system -------------------------------------------------------------------------

def test_a_read_only_root_serves_its_complete_entries(root, compiles, built, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: (
        False if mode & os.W_OK and Path(p).resolve().is_relative_to(root.resolve())
        else real(p, mode, **kw)))
    prepared = _prepare(root, policy="on")
    assert prepared.cache_hit and prepared.weights_cache_hit
    shutil.rmtree(prepared.artifact_dir)
    with pytest.raises(ArtifactError, match=r"is missing or damaged and the artifact root .* is "
                       r"not writable; pass --artifacts .* or --cache off"):
        _prepare(root, policy="on")
    assert compiles == []


def test_a_full_disk_is_an_artifact_error_and_leaves_nothing(root, built, monkeypatch):
    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(api, "write_weight_pack", full)
    shutil.rmtree(_pack(root))
    with pytest.raises(ArtifactError, match=r"could not write .* \(No space left on device\); "
                       r"free disk space"):
        _prepare(root, policy="on")
    assert sorted(p.name for p in (root / "weights").iterdir()) == [".locks", ".tmp"]
    assert not any((root / "weights" / ".tmp").iterdir())


def test_clear_removes_a_symlinked_entry_not_its_target(root, built, tmp_path):
    elsewhere = Path(shutil.move(str(root / built.artifact_dir.name), tmp_path / "elsewhere"))
    (root / built.artifact_dir.name).symlink_to(elsewhere, target_is_directory=True)
    result = CliRunner().invoke(cache_cmd, ["--artifacts", str(root), "--clear", "--yes"])
    assert result.exit_code == 0, result.output
    assert "(a link)" in result.output and "cleared 1 artifacts and 1 weight packs" in result.output
    assert not (root / built.artifact_dir.name).exists() and (elsewhere / "manifest.json").is_file()


def test_an_empty_root_variable_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PAGED_DECODE_ARTIFACTS", "")
    with pytest.raises(ConfigError, match=r"\$PAGED_DECODE_ARTIFACTS is set but empty"):
        cache.artifacts_root()
    with pytest.raises(ConfigError, match=r"--artifacts is empty"):
        cache.artifacts_root(" ")
    result = CliRunner().invoke(cache_cmd, [])
    assert result.exit_code == 1 and "is set but empty" in result.output
    assert list(tmp_path.iterdir()) == []
