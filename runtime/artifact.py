"""Find, verify and load an artifact and its weight pack (TVM runtime only).

Loading checks the manifest's format, ABI, package and TVM versions, its key against its digest,
the library's sha256, and every manifest field against the manifest the library reports through
``_metadata()``; any mismatch is an ``ArtifactError`` whose message holds the ``paged-compile
... --force`` command that rebuilds it.  The library is loaded once per artifact; each session
takes its own VirtualMachine over it (:meth:`Artifact.new_vm`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
from pathlib import Path

import numpy as np
from paged_decode.runtime._tvm import tvm
from tvm.runtime import vm as relax  # relax.VirtualMachine, in the runtime library

from .errors import ArtifactError, WeightsError
from .host_memory import HostArena, on_host, release_free_heap, to_tvm
from .manifest import DEFAULT_BATCH_BUCKETS, DISK_ONLY, Manifest, weight_policy
from .pack import verify_pack
from .versions import ABI_VERSION, MANIFEST_FORMAT, PACKAGE_VERSION, WEIGHTS_FORMAT, key_digest


def set_threads(n: int | None = None) -> None:
    """TVM's CPU pool reads TVM_NUM_THREADS when it starts: default to every core."""
    os.environ.setdefault("TVM_NUM_THREADS", str(n or os.cpu_count() or 1))


def cli_target(target: str) -> str:
    """The ``--target`` option for a key's target string: ``llvm:<mcpu>`` (or the bare kind)."""
    kind = re.search(r'"kind":\s*"(\w+)"', target) or re.match(r"(\w+)", target)
    mcpu = re.search(r'"mcpu":\s*"([^"]+)"|-mcpu=([^\s|]+)', target)
    kind_name = kind.group(1) if kind else "llvm"
    return f"{kind_name}:{mcpu.group(1) or mcpu.group(2)}" if mcpu else kind_name


def buckets_arg(buckets) -> str:
    """``--batch-buckets``' value for a list of bucket sizes: ``2,4,8``, or ``none``."""
    return ",".join(str(b) for b in buckets) or "none"


def compile_command(model: str, options: dict, root: Path | str) -> str:
    """``paged-compile --model MODEL --opt value ... --artifacts ROOT`` for ``options`` (field
    names with underscores, in the order given), the model quoted for a shell."""
    opts = "".join(f" --{field.replace('_', '-')} {value}" for field, value in options.items())
    return f"paged-compile --model {shlex.quote(str(model))}{opts} --artifacts {root}"


def _rebuild_command(manifest: dict | None, path: Path, host: bool = False) -> str:
    """The paged-compile command that rebuilds ``path`` (``host``: for this machine's CPU).

    Options come from the manifest's key when it matches its digest, else from the manifest's
    top-level copies (one of the two was edited), else only the model name of the folder.  The
    model is what ``--model`` took when it was built (``model_arg``), else the model's name.
    """
    m = manifest if isinstance(manifest, dict) else {}
    key = m.get("key") if isinstance(m.get("key"), dict) else {}
    source = key if key and key_digest(key) == m.get("digest") else m
    name = m.get("model_arg") or m.get("name") or path.name.rsplit("-", 2)[0] or "<model>"
    target = source.get("target") or key.get("target") or m.get("target_kind")
    opts = {"target": cli_target(target)} if isinstance(target, str) else {}
    if host:
        opts["target"] = "llvm"
    opts.update((field, source[field]) for field in (
        "block_size", "max_blocks_cap", "cache_dtype") if field in source)
    if isinstance(source.get("weight_dtype"), str):
        opts["weight_dtype"] = weight_policy(source["weight_dtype"], source.get("weight_formats"),
                                             name)
    buckets = source.get("batch_buckets")
    # every target's kernel set batches but WebGPU's (compile/api.py default_buckets)
    default = [] if opts.get("target", "").startswith("webgpu") else list(DEFAULT_BATCH_BUCKETS)
    extra = (f" --batch-buckets {buckets_arg(buckets)}"
             if isinstance(buckets, list) and buckets != default else "")
    return f"{compile_command(name, opts, path.parent)}{extra}"


def _rebuild_hint(manifest: dict | None, path: Path) -> str:
    """How to rebuild ``path``: its paged-compile command with ``--force``."""
    return (f"rebuild it with `{_rebuild_command(manifest, path)} --force` (or delete {path} "
            "and compile again)")


# x86 instruction sets the CPU kernels can be built with: LLVM's name -> /proc/cpuinfo's flag
X86_FEATURES = {"avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
                "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512dq": "avx512dq",
                "avx512vl": "avx512vl", "avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni",
                "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16"}


def host_cpu_flags() -> frozenset[str] | None:
    """This machine's CPU flags as the kernel reports them (``/proc/cpuinfo``); None where
    there is no such file (not Linux): then nothing is checked."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    match = re.search(r"^flags\s*:(.*)$", text, re.M)
    return frozenset(match.group(1).split()) if match else None


def missing_cpu_features(target: str, flags) -> list[str]:
    """The x86 instruction sets (LLVM's names) that code built for ``target`` (a key's target
    string with an ``mcpu``) may use and a CPU with ``flags`` lacks; [] when ``flags`` is None
    or the target names no x86 CPU."""
    mcpu = re.search(r'"mcpu":\s*"([^"]+)"', target or "")
    if flags is None or not mcpu:
        return []
    try:
        built = tvm.target.codegen.llvm_get_cpu_features(
            tvm.target.Target({"kind": "llvm", "mcpu": mcpu.group(1)}))
    except Exception:  # a CPU this LLVM does not know: nothing to compare
        return []
    return [f for f, flag in X86_FEATURES.items() if f in built and flag not in flags]


def _check_host_cpu(parsed: Manifest, path: Path) -> None:
    """Refuse an llvm artifact whose CPU's instructions this one lacks, before its library is
    loaded: the first such instruction would kill the process (SIGILL), not raise."""
    target = parsed.key.get("target")
    missing = missing_cpu_features(target, host_cpu_flags()) if isinstance(target, str) else []
    if missing:
        raise ArtifactError(
            f"{path}: built for {cli_target(target)}, whose instructions {', '.join(missing)} "
            "this CPU lacks (running it would kill the process); compile it for this machine: "
            f"`{_rebuild_command(parsed.to_dict(), path, host=True)}`")


def _read_json(path: Path, what: str, hint: str, error: type = ArtifactError) -> dict:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise error(f"{path}: {what} is missing; {hint}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: {what} is not valid JSON ({e}); {hint}") from e
    if not isinstance(data, dict):
        raise error(f"{path}: {what} holds a {type(data).__name__}, not an object; {hint}")
    return data


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_manifest(manifest: dict, path: Path) -> None:
    """Versions and key digest of a manifest against this runtime."""
    hint = _rebuild_hint(manifest, path)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("key"), dict):
        raise ArtifactError(f"{path}: manifest.json is not an artifact manifest (no key); {hint}")
    key = manifest["key"]
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


def verify_embedded(manifest: dict, embedded: dict, lib_path: Path) -> None:
    """Every field the library reports through ``_metadata()`` must equal the manifest's."""
    hint = _rebuild_hint(embedded, lib_path.parent)
    for field in sorted((set(manifest) | set(embedded)) - set(DISK_ONLY)):
        if manifest.get(field) != embedded.get(field):
            raise ArtifactError(
                f"{lib_path.parent}: manifest field {field}={manifest.get(field)!r} differs from "
                f"the library's {embedded.get(field)!r} (manifest edited or mixed up); {hint}")


@dataclasses.dataclass
class Artifact:
    """A loaded artifact: its manifest, the loaded library and one VirtualMachine.

    ``manifest`` is the parsed, verified manifest.json.  Thread safety: the manifest and library
    are read-only.  ``vm`` is for one-off calls
    (``_metadata``); each :class:`~paged_decode.runtime.session.PagedDecodeSession` takes its own
    VM from :meth:`new_vm`, so sessions in different threads never share VM state.
    """

    path: Path
    manifest: Manifest
    vm: relax.VirtualMachine
    device: tvm.runtime.Device
    lib: tvm.runtime.Module | None = None

    def new_vm(self) -> relax.VirtualMachine:
        """A fresh VirtualMachine over the loaded library (cheap: no reload, no compile)."""
        return self.vm if self.lib is None else relax.VirtualMachine(self.lib, self.device)

    @property
    def max_blocks_cap(self) -> int:
        return self.manifest.max_blocks_cap

    @property
    def block_size(self) -> int:
        return self.manifest.block_size

    @property
    def max_tokens(self) -> int:
        """Tokens one sequence can hold: ``max_blocks_cap * block_size``."""
        return self.manifest.max_tokens

    @property
    def k_block_layout(self) -> str:
        """How this artifact's kernels store a K block (see ``kv_pool.k_rows``)."""
        return self.manifest.k_block_layout


def read_manifest(path: str | Path) -> tuple[Manifest, str]:
    """The manifest of the artifact folder ``path``, its versions and digest verified against
    this runtime, and the hint that rebuilds it (for errors found later)."""
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"{path}: no such artifact folder; pass the folder paged-compile "
                            "printed ('artifact:', or prepare(...).artifact_dir)")
    if not (path / "manifest.json").exists():  # a damaged artifact (a library) gets its hint
        if (path / "weights.json").is_file():
            raise ArtifactError(f"{path} is a weight pack, not an artifact folder: pass the "
                                "artifact folder first and the weight pack second")
        if not any(path.glob("*.so")):
            held = sorted(p.parent.name for p in path.glob("*/manifest.json"))
            raise ArtifactError(f"{path} is not an artifact folder (no manifest.json, no "
                                "library)" + (f"; it holds artifacts: pass one, e.g. "
                                              f"{path / held[0]}" if held else
                                              "; pass the folder paged-compile printed "
                                              "('artifact:', or prepare(...).artifact_dir)"))
    manifest = _read_json(path / "manifest.json", "manifest.json", _rebuild_hint(None, path))
    verify_manifest(manifest, path)
    hint = _rebuild_hint(manifest, path)
    return Manifest.parse(manifest, path, hint), hint


def load_artifact(path: str | Path, device: tvm.runtime.Device | None = None) -> Artifact:
    """Verify and load ``path`` (a folder with manifest.json and the library)."""
    path = Path(path)
    parsed, hint = read_manifest(path)
    lib_path = path / parsed.library
    if not lib_path.is_file():
        raise ArtifactError(f"{lib_path}: library is missing; {hint}")
    if sha256_file(lib_path) != parsed.library_sha256:
        raise ArtifactError(f"{lib_path}: sha256 differs from the manifest (truncated, "
                            f"corrupted or replaced); {hint}")
    if parsed.target_kind == "llvm":
        _check_host_cpu(parsed, path)
    set_threads()
    try:
        lib = tvm.runtime.load_module(str(lib_path))
        vm = relax.VirtualMachine(lib, device or tvm.cpu())
        embedded = json.loads(vm["_metadata"]())
    except Exception as e:  # TVM raises plain RuntimeErrors for unloadable libraries
        if "loader of that name is not registered" in str(e):  # built for another runtime
            raise ArtifactError(
                f"{lib_path}: built for target {parsed.target_kind!r}, whose runtime this "
                f"TVM installation lacks ({e}); run it where TVM has that runtime (and the "
                "device), or compile for a target this machine runs (llvm: the host CPU)") from e
        raise ArtifactError(f"{lib_path}: TVM could not load it ({e}); {hint}") from e
    if not isinstance(embedded, dict) or embedded.get("digest") != parsed.digest:
        got = embedded.get("digest") if isinstance(embedded, dict) else embedded
        raise ArtifactError(f"{lib_path}: library reports key {got!r}, "
                            f"manifest says {parsed.digest!r}; {hint}")
    verify_embedded(parsed.to_dict(), embedded, lib_path)
    return Artifact(path, parsed, vm, device or tvm.cpu(), lib)


@dataclasses.dataclass
class WeightPack:
    """Model weights bound once: the ``params`` tuple in the artifact's order."""

    path: Path
    meta: dict
    params: tuple

    @property
    def shape_key(self) -> str:
        return self.meta["shape_key"]


def _layout_difference(got: list, want: list) -> str:
    """The first ``[name, shape, dtype]`` entry where two parameter layouts differ."""
    for g, w in zip(got, want):
        if g != w:
            return f"pack has {g}, artifact expects {w}"
    return f"pack has {len(got)} parameters, artifact expects {len(want)}"


def load_weights(path: str | Path, artifact: Artifact) -> WeightPack:
    """Load params.safetensors into device tensors in the order the artifact expects.

    On the CPU the file is read straight into one huge-page-backed arena
    (:mod:`.host_memory`) that the tensors then share without a copy; on a GPU each tensor is
    read into host memory and copied over.
    """
    path = Path(path)
    m = artifact.manifest
    model = m.model_arg or m.name
    mixed = m.key.get("weight_formats") if isinstance(m.key, dict) else None
    hint = ("convert the weights again with "
            f"`{_pack_command(model, weight_policy(m.weight_dtype, mixed, model), path)}`")
    if not path.is_dir() or not ((path / "weights.json").exists()
                                 or (path / "params.safetensors").exists()):
        what = "no such weight pack folder" if not path.is_dir() else \
            "not a weight pack folder (no weights.json, no params.safetensors)"
        raise WeightsError(f"{path}: {what}; pass the one paged-compile printed ('weights:', "
                           "or prepare(...).weights_dir)")
    meta = _read_json(path / "weights.json", "weights.json", hint, WeightsError)
    if isinstance(meta.get("model_arg"), str) and isinstance(meta.get("weight_dtype"), str):
        policy = weight_policy(meta["weight_dtype"], meta.get("weight_formats"),
                               meta["model_arg"])
        hint = ("convert the weights again with "
                f"`{_pack_command(meta['model_arg'], policy, path)}`")
    if meta.get("weights_format") != WEIGHTS_FORMAT:
        raise WeightsError(f"{path}: weights_format {meta.get('weights_format')!r}, expected "
                           f"{WEIGHTS_FORMAT}; {hint}")
    want = artifact.manifest.param_layout
    if meta.get("params") != want:
        raise WeightsError(
            f"{path}: weights of model {meta.get('name')!r} have another parameter layout than "
            f"artifact {artifact.path.name} of {artifact.manifest.name!r} "
            f"({_layout_difference(meta.get('params') or [], want)}); use the weight pack "
            "prepare() returned with this artifact")
    file = path / "params.safetensors"
    on_cpu = on_host(artifact.device)
    try:
        with open(file, "rb", buffering=0) as f:
            entries, base = _safetensors_index(f, os.fstat(f.fileno()).st_size)
            for name, shape, dtype in want:
                got = entries.get(name)
                if got is None or got[0] != list(shape) or got[1] != dtype:
                    got_s = None if got is None else f"{got[0]} {got[1]}"
                    raise WeightsError(f"{file}: tensor {name} is {got_s}, weights.json says "
                                       f"{list(shape)} {dtype}; {hint}")
            # the header's structure first (its errors say what is wrong), then every byte
            verify_pack(path, meta, hint)
            hosts = _host_buffers(want, on_cpu, file)
            for name in sorted(hosts, key=lambda n: entries[n][2]):  # in file order
                _read_exactly(f, base + entries[name][2], hosts[name])
    except (OSError, ValueError) as e:
        raise WeightsError(f"{file} is missing or damaged ({e}); {hint}") from e
    tensors = tuple(to_tvm(hosts[n]) if on_cpu else
                    tvm.runtime.tensor(hosts[n], artifact.device) for n, _s, _d in want)
    release_free_heap()  # what parsing the header (and the tokenizer, loaded before) freed
    return WeightPack(path, meta, tensors)


def _pack_command(model: str, weight_dtype: str, pack: Path) -> str:
    """The command that rebuilds the weight pack folder ``pack`` (``<root>/weights/<name>``)."""
    return compile_command(model, {"weight_dtype": weight_dtype}, pack.parent.parent) + " --force"


def _host_buffers(want: list, on_cpu: bool, file: Path) -> dict:
    """Host memory for every parameter: slices of one huge-page arena on the CPU (the tensors
    themselves), plain staging arrays for a GPU."""
    try:
        if not on_cpu:
            return {n: np.empty(s, d) for n, s, d in want}
        arena = HostArena.for_arrays([(s, d) for _n, s, d in want])
        return {n: arena.take(tuple(s), d) for n, s, d in want}
    except (OSError, MemoryError) as e:
        nbytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for _n, s, d in want)
        raise WeightsError(f"{file}: could not allocate {nbytes} bytes of host memory for the "
                           f"weights ({e}); free memory or use a smaller weight dtype") from e


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "I32": "int32", "I8": "int8",
                       "U8": "uint8"}


def _safetensors_index(f, size: int) -> tuple[dict, int]:
    """``{name: (shape, dtype, offset)}`` from a safetensors header, every entry checked against
    the file's size, and the offset where the data starts."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(head, "little")
    if n > size - 8:
        raise ValueError(f"header of {n} bytes in a file of {size}")
    try:
        header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    base, entries = 8 + n, {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(e.get("dtype")) if isinstance(e, dict) else None
        shape, offsets = (e.get("shape"), e.get("data_offsets")) if dtype else (None, None)
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)):
            raise ValueError(f"tensor {name}: entry {e!r} is not a supported tensor")
        start, end = offsets
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if not 0 <= start <= end <= size - base or end - start != nbytes:
            raise ValueError(f"tensor {name}: bytes {start}..{end} do not hold {shape} {dtype} "
                             f"inside the file's {size - base} data bytes")
        entries[name] = (shape, dtype, start)
    return entries, base


def _read_exactly(f, offset: int, out: np.ndarray) -> None:
    view = memoryview(out.reshape(-1).view(np.uint8))
    f.seek(offset)
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise ValueError(f"file ends {len(view) - done} bytes early")
        done += got
