"""Checksums of a weight pack's files, verified once and recorded.

``weights.json`` lists every file of the pack with its size and a chunked sha256 (the sha256 of
the sha256s of its 64 MiB chunks, so the chunks hash in parallel: hashlib releases the GIL).
The first verification of a pack (right after it is written, or after it was copied or
changed) hashes every file and records each file's ``stat`` identity (size, inode, mtime and
ctime in ns) in ``verified.json``; later loads compare only those stats.  Any write to a file
through the file system changes its ctime, so a pack edited, truncated or replaced since is
hashed again and refused if it differs.  A pack in a read-only folder is hashed at every load.

``weights.json`` itself (shape key, formats, parameter layout, the file records) carries
``meta_sha256``, the sha256 of its other fields (:func:`seal`): it is a few kB, so it is checked
at every load, and an edited field is refused like an edited file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
from pathlib import Path

from .errors import WeightsError

CHUNK = 64 << 20
STAMP = "verified.json"
META_DIGEST = "meta_sha256"  # the field of weights.json that covers its other fields


def _chunk_digest(fd: int, offset: int, size: int) -> bytes:
    h = hashlib.sha256()
    done = 0
    while done < size:
        data = os.pread(fd, min(8 << 20, size - done), offset + done)
        if not data:
            raise OSError(f"file ends at byte {offset + done}")
        h.update(data)
        done += len(data)
    return h.digest()


def tree_sha256(path: Path, workers: int | None = None) -> str:
    """sha256 over the sha256 digests of ``path``'s consecutive ``CHUNK``-byte chunks."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        spans = [(o, min(CHUNK, size - o)) for o in range(0, size, CHUNK)]
        with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            digests = list(pool.map(lambda s: _chunk_digest(fd, *s), spans))
    finally:
        os.close(fd)
    return hashlib.sha256(b"".join(digests)).hexdigest()


def file_record(path: Path) -> dict:
    """What ``weights.json`` records of one pack file."""
    return {"bytes": path.stat().st_size, "sha256": tree_sha256(path)}


def meta_digest(meta: dict) -> str:
    """sha256 of ``meta``'s fields but :data:`META_DIGEST`, as JSON (sorted keys): the same
    value before it is written and after it is read back."""
    body = {k: v for k, v in meta.items() if k != META_DIGEST}
    blob = json.dumps(json.loads(json.dumps(body, default=str)), sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def seal(meta: dict) -> dict:
    """``meta`` with :data:`META_DIGEST` over its other fields (what ``weights.json`` holds)."""
    return {**meta, META_DIGEST: meta_digest(meta)}


def _check_seal(path: Path, meta: dict, hint: str) -> None:
    if meta.get(META_DIGEST) != meta_digest(meta):
        what = ("lacks its checksum" if META_DIGEST not in meta else
                "does not match its checksum (a field was edited or corrupted)")
        raise WeightsError(f"{path / 'weights.json'} {what} ({META_DIGEST}); {hint}")


def _stat_id(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _vouched(path: Path, files: dict) -> set[str]:
    """The files whose stats ``verified.json`` recorded and still match."""
    try:
        stamp = json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(stamp, dict):
        return set()
    vouched = set()
    for name in files:
        try:
            if stamp.get(name) == _stat_id(path / name):
                vouched.add(name)
        except OSError:
            pass
    return vouched


def _check_file(path: Path, name: str, want: dict, hint: str) -> None:
    file = path / name
    if not file.is_file():
        raise WeightsError(f"{file} is missing or damaged (the weight pack lists it, the folder "
                           f"lacks it); {hint}")
    size = file.stat().st_size
    if size != want.get("bytes"):
        raise WeightsError(f"{file} is missing or damaged ({size} bytes, the pack recorded "
                           f"{want.get('bytes')}: truncated or replaced); {hint}")
    if tree_sha256(file) != want.get("sha256"):
        raise WeightsError(f"{file} is missing or damaged (its sha256 differs from the pack's "
                           f"record: edited or corrupted); {hint}")


def verify_pack(path: str | Path, meta: dict, hint: str) -> None:
    """``meta`` (weights.json) matches its own checksum (:func:`seal`), and every file
    ``meta["files"]`` lists is present with its recorded size and checksum, else
    :class:`WeightsError` naming the file and ``hint`` (the command that rebuilds the pack).
    Hashes only the files whose current stats ``verified.json`` does not vouch for."""
    path = Path(path)
    files = meta.get("files")
    if not isinstance(files, dict) or not files or not all(
            isinstance(v, dict) for v in files.values()):
        raise WeightsError(f"{path}: weights.json lists no file checksums; {hint}")
    _check_seal(path, meta, hint)
    try:
        todo = sorted(set(files) - _vouched(path, files))
        for name in todo:
            _check_file(path, name, files[name], hint)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read the weight pack ({e}); {hint}") from e
    if todo:
        record_verified(path, files)


def record_verified(path: Path, files) -> None:
    """Write ``verified.json`` for ``files`` as they are now (skipped where the folder is
    read-only: such packs are hashed at every load)."""
    tmp = path / f".{STAMP}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps({name: _stat_id(path / name) for name in files}))
        os.replace(tmp, path / STAMP)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
