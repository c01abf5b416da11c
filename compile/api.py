"""The build side's entry points: ensure an artifact and a weight pack exist for a model."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np

from paged_decode.runtime._tvm import require_compiler

require_compiler()  # before .build imports tvm.relax: a clear error in a runtime-only process

from paged_decode.runtime.artifact import (buckets_arg, cli_target, compile_command, read_manifest,
                                           sha256_file)
from paged_decode.runtime.errors import ArtifactError, ConfigError, WeightsError
from paged_decode.runtime.manifest import DEFAULT_BATCH_BUCKETS, Manifest, weight_policy
from paged_decode.runtime.pack import file_record, record_verified, seal, verify_pack
from paged_decode.runtime.versions import WEIGHTS_FORMAT

from . import cache
from .build import build_into, make_spec, manifest_for
from .kernels.registry import kernels_for, no_byte_weights, no_quantized_kernels
from .model import BuildSpec
from .params import param_specs
from .targets import TargetSpec, resolve_target
from .tokenizer_export import export_tokenizer
from .weights import ModelSource, interleave_formats, resolve_formats, resolve_model

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """An artifact folder and the weight pack that goes with it."""

    artifact_dir: Path
    weights_dir: Path
    manifest: Manifest
    cache_hit: bool
    weights_cache_hit: bool


def shape_key(source: ModelSource, weight_dtype: str, weight_formats=()) -> str:
    """Which model weights: the shape config, the weight values and their formats."""
    fields = {"model": source.config.shape_dict(), "weights": source.weights_key,
              "weight_dtype": weight_dtype}
    if weight_formats:
        fields["weight_formats"] = dict(weight_formats)
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _manifest_complete(path: Path) -> bool:
    """A valid manifest of this runtime's versions whose library is present with the recorded
    sha256.

    A damaged entry counts as absent: policy ``on`` rebuilds it, ``readonly`` refuses it.
    """
    try:
        manifest, _hint = read_manifest(path)
        lib = path / manifest.library
        if lib.is_file() and sha256_file(lib) == manifest.library_sha256:
            return True
    except (OSError, ArtifactError):
        pass
    if path.exists():
        log.warning("%s is incomplete or damaged: treated as not built", path)
    return False


def _weights_complete(path: Path) -> bool:
    """weights.json (written last) is there, names this version's weights format, and every
    file it lists has its recorded size and checksum (:func:`~paged_decode.runtime.pack.
    verify_pack`): a pack in another layout or damaged counts as absent (policy ``on`` converts
    the weights again, ``readonly`` names the command that does)."""
    try:
        meta = json.loads((path / "weights.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("weights_format") != WEIGHTS_FORMAT:
        log.warning("%s holds weights format %s, this version reads %s: treated as absent", path,
                    meta.get("weights_format") if isinstance(meta, dict) else None,
                    WEIGHTS_FORMAT)
        return False
    try:
        verify_pack(path, meta, "it is converted again")
    except WeightsError as e:
        log.warning("%s", e)
        return False
    return True


def artifact_name(spec: BuildSpec, target: TargetSpec) -> str:
    digest = manifest_for(spec, target)["digest"]
    return f"{cache.safe_name(spec.config.name)}-{target.kind}-{digest}"


def ensure_artifact(spec: BuildSpec, target: TargetSpec, root: Path, policy: str,
                    model_arg: str, stage=None, **lock) -> tuple[Path, bool]:
    """The artifact folder for ``spec`` on ``target`` under ``root`` (built under its lock
    unless ``policy`` reuses it), and whether it was a cache hit.  ``model_arg``: what
    ``--model`` takes to name the model again, for the rebuild hints; ``stage``: told each
    compile step (:func:`~.build.compile_library`); ``lock``: ``lock_timeout`` and ``waiting``
    of :func:`~.cache.locked_build`."""
    name = artifact_name(spec, target)
    options = {"target": cli_target(target.key_string), "block_size": spec.block_size,
               "max_blocks_cap": spec.max_blocks_cap, "cache_dtype": spec.cache_dtype,
               "weight_dtype": _policy_arg(spec, model_arg)}
    hint = compile_command(model_arg, options, root)
    if spec.batch_buckets != default_buckets(target.kind):
        hint += f" --batch-buckets {buckets_arg(spec.batch_buckets)}"
    return cache.locked_build(
        root, name, lambda d: build_into(spec, target, d, model_arg, stage,
                                         twin=_twin(root, name, policy)),
        _manifest_complete, policy, hint, **lock)


def _twin(root: Path, name: str, policy: str) -> Path | None:
    """A complete artifact under ``root`` with ``name``'s key under another model name (a
    fine-tune of the same base, a model's HF folder and its GGUF): the key leaves the name out,
    so its library is this one's.  None under policy ``redo``, which compiles."""
    if policy == "redo":
        return None
    suffix = name[len(name.rsplit("-", 2)[0]):]  # "-<target kind>-<digest>"
    for entry in sorted(root.glob(f"*{suffix}")):
        if (entry.name != name and entry.name.endswith(suffix) and _manifest_complete(entry)
                and read_manifest(entry)[0].digest == suffix.rsplit("-", 1)[1]):
            return entry
    return None


def _policy_arg(spec: BuildSpec, model_arg: str | None = None) -> str:
    """The ``--weight-dtype`` that gives ``spec``'s formats again: its one format, a k-quant
    mix, or "auto" for a GGUF's own mix."""
    return weight_policy(spec.weight_dtype, spec.weight_formats, model_arg)


def write_weight_pack(source: ModelSource, weight_dtype: str, out_dir: Path,
                      weight_formats=()) -> None:
    """params.safetensors (our layout), the tokenizer, and weights.json written last."""
    from safetensors.numpy import save_file

    params = source.load_params(weight_dtype, weight_formats)
    specs = param_specs(source.config, weight_dtype, weight_formats)
    for s in specs:
        arr = params.get(s.name)
        if arr is None or tuple(arr.shape) != s.shape or str(arr.dtype) != s.dtype:
            raise WeightsError(f"weight {s.name}: expected {s.shape} {s.dtype}, got "
                               f"{None if arr is None else (arr.shape, arr.dtype)}")
    save_file({s.name: params[s.name] for s in specs}, str(out_dir / "params.safetensors"))
    if source.kind != "hf" or (source.path / "tokenizer.json").is_file():
        export_tokenizer(source, out_dir)
    else:
        log.warning("%s has no tokenizer.json: the pack serves token ids only", source.path)
    # checksums of what was written, read back (a short write or a bad disk shows here)
    files = {f.name: file_record(f) for f in sorted(out_dir.iterdir()) if f.is_file()}
    meta = {"weights_format": WEIGHTS_FORMAT, "name": source.config.name,
            "model_arg": source.cli_name or source.config.name,
            "shape_key": shape_key(source, weight_dtype, weight_formats),
            "weights_key": source.weights_key, "weight_dtype": weight_dtype,
            "weight_formats": dict(weight_formats), "model": source.config.shape_dict(),
            "params": [[s.name, list(s.shape), s.dtype] for s in specs], "files": files}
    record_verified(out_dir, files)
    (out_dir / "weights.json").write_text(json.dumps(seal(meta), indent=1, sort_keys=True,
                                                     default=str))


def ensure_weights(source: ModelSource, weight_dtype: str, root: Path, policy: str,
                   weight_formats=(), **lock) -> tuple[Path, bool]:
    wroot = root / "weights"
    if policy in ("on", "redo"):
        wroot.mkdir(exist_ok=True)
    # the format in the name: packs of two versions sharing a root sit side by side
    mix = ("-" + hashlib.sha256(json.dumps(sorted(weight_formats)).encode()).hexdigest()[:8]
           if weight_formats else "")
    name = (f"{cache.safe_name(source.config.name)}-{source.weights_key}-{weight_dtype}{mix}"
            f"-w{WEIGHTS_FORMAT}")
    model = source.cli_name or source.config.name
    hint = compile_command(model, {"weight_dtype": weight_policy(
        weight_dtype, weight_formats, str(source.path) if source.kind == "gguf" else model)}, root)
    return cache.locked_build(
        wroot, name, lambda d: write_weight_pack(source, weight_dtype, d, weight_formats),
        _weights_complete, policy, hint, **lock)


def key_of(model: str | None = None, *, target: str | None = None,
           block_size: int | None = None, max_context: int | None = None,
           max_blocks_cap: int | None = None, cache_dtype: str = "float32",
           weight_dtype: str = "auto", batch_buckets=None) -> dict:
    """The artifact key fields and digest, without compiling."""
    source = resolve_model(model)
    tspec = resolve_target(target)
    spec = _spec(source, tspec, block_size, max_context, max_blocks_cap, cache_dtype,
                 weight_dtype, batch_buckets)
    m = manifest_for(spec, tspec)
    return {"digest": m["digest"], "key": m["key"]}


def default_buckets(target_kind: str) -> tuple[int, ...]:
    """:data:`DEFAULT_BATCH_BUCKETS` where the target's kernel set batches, else none."""
    batches = kernels_for(target_kind).paged_attention_batch is not None
    return DEFAULT_BATCH_BUCKETS if batches else ()


def _spec(source, tspec, block_size, max_context, max_blocks_cap, cache_dtype, weight_dtype,
          batch_buckets=None):
    """The build spec, with the defaults that depend on the model (context) and the target
    (``block_size`` None: ``tspec.default_block_size``; ``batch_buckets`` None:
    :data:`DEFAULT_BATCH_BUCKETS` where the target's kernels batch, else none)."""
    if max_context is None and max_blocks_cap is None:
        max_context = min(source.config.max_position_embeddings, 2048,
                          source.config.rope_max_context or 2048)
    if block_size is None:
        block_size = tspec.default_block_size
    if batch_buckets is None:
        batch_buckets = default_buckets(tspec.kind)
    elif batch_buckets and kernels_for(tspec.kind).paged_attention_batch is None:
        raise ConfigError(f"batch_buckets={list(batch_buckets)}: target {tspec.kind} has no "
                          "batched decode kernels (its device code has no int64 buffers); "
                          "build it with --batch-buckets none")
    no_quantized = no_quantized_kernels(tspec.kind, tspec.target)
    base, formats = resolve_formats(source, weight_dtype, no_quantized=no_quantized,
                                    no_bytes=no_byte_weights(tspec.kind))
    if tspec.kind == "llvm" and not no_quantized:
        base, formats = interleave_formats(source.config, base, formats)
    spec = make_spec(source.config, block_size=block_size, max_blocks_cap=max_blocks_cap,
                     max_context=max_context, cache_dtype=cache_dtype, weight_dtype=base,
                     batch_buckets=batch_buckets, weight_formats=formats)
    if tspec.kind != "llvm":
        _check_gpu_tensor_sizes(spec, tspec.kind)
    return spec


GPU_MAX_TENSOR_BYTES = 2 ** 31  # GPU kernels index a tensor with int32


def _check_gpu_tensor_sizes(spec: BuildSpec, kind: str) -> None:
    for p in spec.param_specs():
        nbytes = int(np.prod(p.shape)) * np.dtype(p.dtype).itemsize
        if nbytes >= GPU_MAX_TENSOR_BYTES:
            raise ConfigError(f"{p.name} ({p.format}, {nbytes / 2 ** 30:.2f} GiB) reaches 2 GiB, "
                              f"past the int32 indices of the {kind} kernels; choose a smaller "
                              "weight format for it (--weight-dtype q8_0 or q4_0) or the llvm "
                              "target")


def weights_line(name: str, weight_dtype: str, weight_formats) -> str:
    """The progress line naming a model's weight formats: the default, then each other format
    with the one matrix it holds or its count of matrices."""
    by_format: dict[str, list[str]] = {}
    for matrix, fmt in weight_formats:
        by_format.setdefault(fmt, []).append(matrix)
    others = "".join(f", {names[0]} {fmt}" if len(names) == 1 else f", {len(names)} matrices {fmt}"
                     for fmt, names in sorted(by_format.items(), key=lambda kv: -len(kv[1])))
    return f"weights of {name} as {weight_dtype}{others}"


def context_warning(spec: BuildSpec, by_blocks: bool = False) -> str | None:
    """What to tell a user whose artifact holds more tokens per sequence than the model was
    trained on (``max_position_embeddings``): allowed, but positions past it are out of
    distribution.  ``by_blocks``: the capacity came from ``--max-blocks-cap``."""
    tokens, bs = spec.max_tokens, spec.block_size
    limit = spec.config.max_position_embeddings
    if tokens <= limit:
        return None
    blocks = max(limit // bs, 1)
    fix = f"--max-blocks-cap {blocks}" if by_blocks else f"--max-context {blocks * bs}"
    return (f"the artifact holds {tokens} tokens per sequence ({spec.max_blocks_cap} blocks of "
            f"{bs}), more than {spec.config.name}'s max_position_embeddings ({limit}): positions "
            f"past {limit} were never trained, so output there may degrade; {fix} stays within it")


def prepare(model: str | ModelSource | None = None, *, target: str | None = None,
            block_size: int | None = None,
            max_context: int | None = None, max_blocks_cap: int | None = None,
            cache_dtype: str = "float32", weight_dtype: str = "auto", batch_buckets=None,
            artifacts: str | Path | None = None, policy: str | None = None,
            force: bool = False, progress: Callable[[str], None] | None = None,
            lock_timeout: float = cache.LOCK_TIMEOUT_S) -> Prepared:
    """Resolve the model (or take a resolved ``ModelSource``), then build (or reuse) its
    artifact and weight pack.

    ``block_size`` None takes the target's default (``TargetSpec.default_block_size``: 64 on
    the CPU, 16 on GPUs).
    ``progress`` receives a line before each long step (compile, weight conversion), and a
    ``warning: ...`` line for a capacity above the model's ``max_position_embeddings`` (without
    ``progress`` that warning goes to the log).
    Safe to call from several threads or processes at once on one artifact root: one of them
    builds each entry, the others wait for its lock (at most ``lock_timeout`` seconds, then
    :class:`LockTimeoutError`) and reuse it (see :mod:`.cache`).  ``force`` (policy ``redo``)
    rebuilds the library and the weight pack.
    """
    say = progress or (lambda _msg: None)
    source = resolve_model(model)
    tspec = resolve_target(target)
    spec = _spec(source, tspec, block_size, max_context, max_blocks_cap, cache_dtype,
                 weight_dtype, batch_buckets)
    warning = context_warning(spec, by_blocks=max_blocks_cap is not None)
    if warning and progress is not None:
        say(f"warning: {warning}")
    elif warning:
        log.warning("%s", warning)
    root = cache.artifacts_root(artifacts)
    policy = "redo" if force else cache.cache_policy(policy)
    say(f"artifact {artifact_name(spec, tspec)} (cache policy {policy})")
    if not isinstance(lock_timeout, (int, float)) or not lock_timeout >= 0:
        raise ConfigError(f"lock_timeout={lock_timeout!r}: must be a number of seconds >= 0 "
                          "(flag --lock-timeout)")
    lock = {"lock_timeout": float(lock_timeout), "waiting": progress}
    t0 = time.perf_counter()
    art_dir, hit = ensure_artifact(spec, tspec, root, policy,
                                   source.cli_name or source.config.name,
                                   _stage_lines(say, t0, "compile"), **lock)
    say(weights_line(source.config.name, spec.weight_dtype, spec.weight_formats))
    w_dir, w_hit = ensure_weights(source, spec.weight_dtype, root, policy,
                                  spec.weight_formats, **lock)
    if not (hit and w_hit) and policy != "off":
        say(f"built in {time.perf_counter() - t0:.0f} s, once: cached for next time under {root}")
    return Prepared(art_dir, w_dir, read_manifest(art_dir)[0], hit, w_hit)


def _stage_lines(say: Callable[[str], None], t0: float, what: str):
    """``stage(i, n, text)`` as a ``[i/n] compile: text (elapsed)`` progress line."""
    def stage(i: int, n: int, text: str) -> None:
        say(f"[{i}/{n}] {what}: {text} ({time.perf_counter() - t0:.0f} s so far)")
    return stage
