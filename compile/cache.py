"""Where artifacts and weight packs live, and how they are built safely.

Layout under the artifact root::

  <model>-<target>-<digest>/      model.so | model.tar, manifest.json
  weights/<model>-<weights_key>-<dtype>-w<format>/   params.safetensors, weights.json, tokenizer
  .locks/<name>.lock              one file lock per entry
  .tmp/<name>-<pid>-<rand>/       builds in progress (renamed into place when complete)
  .tmp/<name>.old-<pid>-<rand>/   a replaced entry, deleted right after the rename
  .index/<request>.json           which entries a build request gave (runtime/locate.py)

The root defaults to the user's cache folder (``~/.cache/paged-decode`` on Linux), never the
installed package's folder.

A complete entry is used without the lock (and without writing anything, so a read-only root
serves its complete entries).  A build runs in a temp dir under the entry's file lock
(``flock``: released by the kernel when the holder dies), writes its manifest last, and is
renamed into place atomically, so concurrent builders of one key (threads or processes) leave
one entry and a killed build leaves nothing a loader would accept.  The lock file names its
holder; a waiter says whom it waits for and gives up after the lock timeout (a holder that is
stopped, not dead, keeps its lock).  ``.tmp/`` entries whose pid is no longer alive are swept before each build
(pids are host-local: share a root between hosts only read-only).  Cache policy (as mlc-llm's):
``on`` reuse or build, ``off`` build into a fresh system temp dir that is deleted when the process
exits and keep nothing in the root, ``redo`` rebuild and replace, ``readonly`` never build.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from paged_decode.runtime.errors import ArtifactError, ConfigError, LockTimeoutError
from paged_decode.runtime.locate import ROOT_ENV, artifacts_root  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

POLICIES = ("on", "off", "redo", "readonly")
POLICY_ENV = "PAGED_DECODE_CACHE"
LOCK_TIMEOUT_S = 600.0  # default wait for another builder of the same entry


def cache_policy(policy: str | None = None) -> str:
    policy = policy or os.environ.get(POLICY_ENV, "on")
    if policy not in POLICIES:
        raise ConfigError(f"cache policy {policy!r}: choose one of {list(POLICIES)} "
                          f"(flag --cache or ${POLICY_ENV})")
    return policy


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def _try_lock(fh) -> bool:
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def file_lock(root: Path, name: str, timeout: float = LOCK_TIMEOUT_S,
              waiting: Callable[[str], None] | None = None):
    """Hold ``root/.locks/<name>.lock``.  While another process holds it, say (``waiting``, else
    the log) whom we wait for, and after ``timeout`` seconds raise :class:`LockTimeoutError`."""
    locks = root / ".locks"
    locks.mkdir(exist_ok=True)
    path = locks / f"{name}.lock"
    with open(path, "a+") as fh:  # "a+": opening must not wipe the holder's note
        if not _try_lock(fh):
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            msg = f"waiting for {holder}, which is building {name} (lock {path})"
            (waiting or log.warning)(msg)
            deadline = time.monotonic() + timeout
            while not _try_lock(fh):
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(
                        f"{path}: {holder} has held the build lock of {name} for over "
                        f"{timeout:g} s; if that process is stopped or hung, end it, or wait "
                        "longer with --lock-timeout SECONDS")
                time.sleep(0.2)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        fh.flush()
        try:
            yield
        finally:
            fh.truncate(0)
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def sweep_stale(tmp_root: Path) -> list[Path]:
    """Delete ``.tmp/`` entries left by builders that died (their pid is gone); returns them."""
    swept = []
    for entry in tmp_root.iterdir() if tmp_root.is_dir() else ():
        parts = entry.name.rsplit("-", 2)
        if len(parts) == 3 and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            shutil.rmtree(entry, ignore_errors=True)
            swept.append(entry)
    if swept:
        log.info("removed %d stale build dir(s) under %s", len(swept), tmp_root)
    return swept


def _tmp_name(name: str) -> str:
    return f"{name}-{os.getpid()}-{secrets.token_hex(4)}"


def _replace_dir(src: Path, dst: Path, tmp_root: Path) -> None:
    """Move ``src`` to ``dst``; an existing ``dst`` is moved into ``tmp_root`` first and then
    deleted (a crash in between leaves it there for :func:`sweep_stale`)."""
    old = None
    if dst.exists():
        old = tmp_root / _tmp_name(f"{dst.name}.old")
        os.rename(dst, old)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _build_off(name: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """Policy ``off``: a system temp dir, deleted at exit (or at once if the build fails)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"paged-decode-{name}-"))
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return tmp, False


def locked_build(root: Path, name: str, build: Callable[[Path], None], is_complete:
                 Callable[[Path], bool], policy: str, rebuild_hint: str,
                 lock_timeout: float = LOCK_TIMEOUT_S,
                 waiting: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """Return (entry dir, cache_hit).  ``build(tmp_dir)`` fills a fresh directory.

    Safe to call from several threads and processes at once for one ``root`` and ``name``:
    exactly one builds, the others wait for its lock (up to ``lock_timeout`` seconds, telling
    ``waiting`` whom they wait for) and reuse the result.  A complete entry under policy ``on``
    is returned without the lock and without writing.
    """
    final = root / name
    if policy == "off":
        return _build_off(name, build)
    if policy in ("on", "readonly") and is_complete(final):
        return final, True
    if policy == "readonly":
        raise ArtifactError(f"{final} is missing or incomplete and the cache policy is "
                            f"readonly; build it with: {rebuild_hint}")
    if not os.access(root, os.W_OK):
        raise ArtifactError(f"{final} is missing or damaged and the artifact root {root} is not "
                            "writable; pass --artifacts naming a writable folder, or --cache off "
                            "to build into a temporary one")
    try:
        with file_lock(root, name, lock_timeout, waiting):
            if policy == "on" and is_complete(final):
                return final, True
            tmp_root = root / ".tmp"
            tmp_root.mkdir(exist_ok=True)
            sweep_stale(tmp_root)
            tmp = tmp_root / _tmp_name(name)
            tmp.mkdir()
            try:
                build(tmp)
                _replace_dir(tmp, final, tmp_root)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # disk full, quota, a root made read-only under us
        raise ArtifactError(f"could not write {name} under {root} ({e.strerror or e}); free "
                            "disk space or pass --artifacts naming another folder") from e
    return final, False
