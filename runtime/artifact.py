"""Find, verify and load an artifact and its weight pack (TVM runtime only).

Loading checks the manifest's format, ABI, package and TVM versions, the library's sha256 and
the digest the library reports through ``_metadata()``; any mismatch is an ``ArtifactError``
that says how to rebuild.  The VM is created once per artifact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from .errors import ArtifactError, WeightsError
from .versions import ABI_VERSION, MANIFEST_FORMAT, PACKAGE_VERSION, WEIGHTS_FORMAT, key_digest


def set_threads(n: int | None = None) -> None:
    """TVM's CPU pool reads TVM_NUM_THREADS when it starts: default to every core."""
    os.environ.setdefault("TVM_NUM_THREADS", str(n or os.cpu_count() or 1))


def _rebuild_hint(manifest: dict | None, path: Path) -> str:
    name = (manifest or {}).get("name", "<model>")
    return (f"rebuild it with `paged-compile --model {name} --force` "
            f"(or delete {path} and compile again)")


def _read_json(path: Path, what: str, hint: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: {what} is missing; {hint}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: {what} is not valid JSON ({e}); {hint}") from e


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_manifest(manifest: dict, path: Path) -> None:
    """Versions and key digest of a manifest against this runtime."""
    hint = _rebuild_hint(manifest, path)
    key = manifest.get("key") or {}
    expected = {"manifest_format": (manifest.get("manifest_format"), MANIFEST_FORMAT),
                "abi_version": (key.get("abi_version"), ABI_VERSION),
                "package_version": (key.get("package_version"), PACKAGE_VERSION),
                "tvm_version": (key.get("tvm_version"), tvm.__version__)}
    for field, (got, want) in expected.items():
        if got != want:
            raise ArtifactError(f"{path}: built with {field}={got!r}, this runtime has {want!r}; "
                                f"{hint}")
    if key_digest(key) != manifest.get("digest"):
        raise ArtifactError(f"{path}: manifest key does not match its digest "
                            f"{manifest.get('digest')!r} (edited or damaged); {hint}")


@dataclasses.dataclass
class Artifact:
    """A loaded artifact: its manifest and one VirtualMachine."""

    path: Path
    manifest: dict
    vm: relax.VirtualMachine
    device: tvm.runtime.Device

    @property
    def max_blocks_cap(self) -> int:
        return self.manifest["max_blocks_cap"]

    @property
    def block_size(self) -> int:
        return self.manifest["block_size"]


def load_artifact(path: str | Path, device: tvm.runtime.Device | None = None) -> Artifact:
    """Verify and load ``path`` (a folder with manifest.json and the library)."""
    path = Path(path)
    manifest = _read_json(path / "manifest.json", "manifest.json", _rebuild_hint(None, path))
    verify_manifest(manifest, path)
    hint = _rebuild_hint(manifest, path)
    lib_path = path / manifest.get("library", "model.so")
    if not lib_path.is_file():
        raise ArtifactError(f"{lib_path}: library is missing; {hint}")
    if sha256_file(lib_path) != manifest.get("library_sha256"):
        raise ArtifactError(f"{lib_path}: sha256 differs from the manifest (truncated, "
                            f"corrupted or replaced); {hint}")
    set_threads()
    try:
        lib = tvm.runtime.load_module(str(lib_path))
        vm = relax.VirtualMachine(lib, device or tvm.cpu())
        embedded = json.loads(vm["_metadata"]())
    except Exception as e:  # TVM raises plain RuntimeErrors for unloadable libraries
        raise ArtifactError(f"{lib_path}: TVM could not load it ({e}); {hint}") from e
    if embedded.get("digest") != manifest["digest"]:
        raise ArtifactError(f"{lib_path}: library reports key {embedded.get('digest')!r}, "
                            f"manifest says {manifest['digest']!r}; {hint}")
    return Artifact(path, manifest, vm, device or tvm.cpu())


@dataclasses.dataclass
class WeightPack:
    """Model weights bound once: the ``params`` tuple in the artifact's order."""

    path: Path
    meta: dict
    params: tuple

    @property
    def shape_key(self) -> str:
        return self.meta["shape_key"]


def load_weights(path: str | Path, artifact: Artifact) -> WeightPack:
    """Load params.safetensors into device tensors in the order the artifact expects."""
    from safetensors.numpy import load_file

    path = Path(path)
    meta = _read_json(path / "weights.json", "weights.json",
                      "convert the weights again with paged-compile")
    if meta.get("weights_format") != WEIGHTS_FORMAT:
        raise WeightsError(f"{path}: weights_format {meta.get('weights_format')!r}, expected "
                           f"{WEIGHTS_FORMAT}; convert them again with paged-compile")
    if meta["params"] != artifact.manifest["params"]:
        raise WeightsError(f"{path}: parameter layout differs from artifact {artifact.path} "
                           "(another model or weight dtype); use the weight pack built with it")
    arrays = load_file(str(path / "params.safetensors"))
    params = tuple(tvm.runtime.tensor(np.ascontiguousarray(arrays[name]), artifact.device)
                   for name, _, _ in meta["params"])
    return WeightPack(path, meta, params)
