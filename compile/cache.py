"""Where artifacts and weight packs live, and how they are built safely.

Layout under the artifact root::

  <model>-<target>-<digest>/      model.so | model.tar, manifest.json
  weights/<model>-<weights_key>-<dtype>/   params.safetensors, weights.json, tokenizer files
  .locks/<name>.lock              one file lock per entry
  .tmp/<name>-<pid>-<rand>/       builds in progress (renamed into place when complete)

A build runs in a temp dir under the entry's file lock, writes its manifest last, and is renamed
into place atomically, so concurrent builders of one key leave one entry and a killed build leaves
nothing a loader would accept.  Cache policy (as mlc-llm's): ``on`` reuse or build, ``off`` build
into a fresh temp dir and keep nothing, ``redo`` rebuild and replace, ``readonly`` never build.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from paged_decode.runtime.errors import ArtifactError, ConfigError

POLICIES = ("on", "off", "redo", "readonly")
ROOT_ENV = "PAGED_DECODE_ARTIFACTS"
POLICY_ENV = "PAGED_DECODE_CACHE"


def artifacts_root(root: str | Path | None = None) -> Path:
    """``root``, else $PAGED_DECODE_ARTIFACTS, else the package's artifacts/ folder if writable,
    else ~/.cache/paged-decode/artifacts."""
    if root is None:
        root = os.environ.get(ROOT_ENV)
    if root is None:
        pkg = Path(__file__).resolve().parent.parent / "artifacts"
        root = pkg if os.access(pkg if pkg.exists() else pkg.parent, os.W_OK) else (
            Path.home() / ".cache" / "paged-decode" / "artifacts")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return root


def cache_policy(policy: str | None = None) -> str:
    policy = policy or os.environ.get(POLICY_ENV, "on")
    if policy not in POLICIES:
        raise ConfigError(f"cache policy {policy!r}: choose one of {list(POLICIES)} "
                          f"(flag --cache or ${POLICY_ENV})")
    return policy


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


@contextlib.contextmanager
def file_lock(root: Path, name: str):
    locks = root / ".locks"
    locks.mkdir(exist_ok=True)
    with open(locks / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; an existing ``dst`` is moved aside first and then deleted."""
    old = None
    if dst.exists():
        old = dst.with_name(f".old-{dst.name}-{secrets.token_hex(4)}")
        os.rename(dst, old)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def locked_build(root: Path, name: str, build: Callable[[Path], None], is_complete:
                 Callable[[Path], bool], policy: str, rebuild_hint: str) -> tuple[Path, bool]:
    """Return (entry dir, cache_hit).  ``build(tmp_dir)`` fills a fresh directory."""
    final = root / name
    if policy == "off":
        tmp = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        build(tmp)
        return tmp, False
    if policy == "readonly":
        if not is_complete(final):
            raise ArtifactError(f"{final} is missing or incomplete and the cache policy is "
                                f"readonly; build it with: {rebuild_hint}")
        return final, True
    with file_lock(root, name):
        if policy == "on" and is_complete(final):
            return final, True
        tmp_root = root / ".tmp"
        tmp_root.mkdir(exist_ok=True)
        tmp = tmp_root / f"{name}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            build(tmp)
            _replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final, False
