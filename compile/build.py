"""Model -> IRModule -> ``relax.build`` -> ``export_library``, with the manifest and its keys.

The artifact key (what makes a different library) covers the model's shape config, the cache
layout, dtypes, target, exec mode and every version that changes the compiled code; weight values
are not in it.  See :mod:`paged_decode.compile.cache` for where artifacts live.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import tvm
from tvm import relax

from paged_decode.runtime.artifact import sha256_file
from paged_decode.runtime.errors import CompileError, ConfigError
from paged_decode.runtime.versions import (ABI_VERSION, MANIFEST_FORMAT, PACKAGE_VERSION,
                                           key_digest)

from .config import DTYPES, ModelConfig
from .formats import FORMATS
from .device_code import cuda_compile_callback, fatbin_packer
from .kernels.registry import NO_INT64_BUFFERS, kernels_for
from .model import BuildSpec, build_module
from .params import param_specs
from .targets import TargetSpec

log = logging.getLogger(__name__)
EXEC_MODE = "compiled"


MAX_BATCH = 256  # rows of the largest batch bucket


def check_buckets(batch_buckets) -> tuple[int, ...]:
    """Batch buckets as a sorted tuple of distinct integers in [2, MAX_BATCH] (B = 1 is
    ``decode``), else :class:`ConfigError`."""
    if isinstance(batch_buckets, (str, bytes)) or not hasattr(batch_buckets, "__iter__"):
        raise ConfigError(f"batch_buckets={batch_buckets!r}: must be a list of row counts "
                          "(flag --batch-buckets 2,4,8)")
    buckets = list(batch_buckets)
    bad = [b for b in buckets if isinstance(b, bool) or not isinstance(b, int)
           or not 2 <= b <= MAX_BATCH]
    if bad:
        raise ConfigError(f"batch bucket {bad[0]!r}: must be an integer in [2, {MAX_BATCH}] "
                          "(one row is the decode function itself)")
    if len(set(buckets)) != len(buckets):
        raise ConfigError(f"batch_buckets={buckets}: each bucket once")
    return tuple(sorted(buckets))


def make_spec(cfg: ModelConfig, *, block_size: int, max_blocks_cap: int | None = None,
              max_context: int | None = None, cache_dtype: str = "float32",
              weight_dtype: str = "float32", batch_buckets=(), weight_formats=()
              ) -> BuildSpec:
    """Validate the cache options; ``max_context`` rounds up to whole blocks.  ``block_size``
    has no default here: the target's (``TargetSpec.default_block_size``) is applied by
    ``api.prepare`` / ``api.key_of``."""
    if not isinstance(block_size, int) or block_size < 1 or block_size > 1024:
        raise ConfigError(f"block_size={block_size!r}: must be an integer in [1, 1024]")
    if (max_blocks_cap is None) == (max_context is None):
        raise ConfigError(f"max_blocks_cap={max_blocks_cap!r}, max_context={max_context!r}: give "
                          "exactly one of them (flags --max-blocks-cap / --max-context)")
    if max_context is not None:
        if not isinstance(max_context, int) or max_context < 1:
            raise ConfigError(f"max_context={max_context!r}: must be a positive integer")
        max_blocks_cap = -(-max_context // block_size)
    if not isinstance(max_blocks_cap, int) or max_blocks_cap < 1:
        raise ConfigError(f"max_blocks_cap={max_blocks_cap!r}: must be a positive integer")
    _check_rope_context(cfg, max_blocks_cap, block_size, max_context is None)
    if cache_dtype not in DTYPES:
        raise ConfigError(f"cache_dtype={cache_dtype!r}: choose one of {list(DTYPES)}")
    for value in [weight_dtype, *dict(weight_formats).values()]:
        if value not in FORMATS:
            raise ConfigError(f"weight_dtype={value!r}: choose one of {list(FORMATS)}")
    return BuildSpec(cfg, max_blocks_cap, block_size, cache_dtype, weight_dtype,
                     check_buckets(batch_buckets), tuple(sorted(dict(weight_formats).items())))


def _check_rope_context(cfg: ModelConfig, cap: int, block_size: int, by_blocks: bool) -> None:
    """A longrope model runs its short factors only (``ModelConfig.rope_max_context``):
    transformers and llama.cpp switch to the long ones past original_max_position_embeddings,
    so an artifact holding more positions is refused."""
    limit, tokens = cfg.rope_max_context, cap * block_size
    if limit and tokens > limit:
        fix = (f"--max-blocks-cap <= {limit // block_size}" if by_blocks
               else f"--max-context <= {limit // block_size * block_size}")
        raise ConfigError(f"the artifact would hold {tokens} tokens per sequence ({cap} blocks of "
                          f"{block_size}), past {cfg.name}'s original_max_position_embeddings "
                          f"({limit}): longrope's long factors, used beyond it, are not "
                          f"supported; {fix}")


# The build side's modules that shape the compiled library (graph, kernels, parameter layout,
# target and device-code handling).  Weight conversion, the tokenizer export, the cache, the
# API, the CLI and the benchmark do not: editing them keeps every artifact key.
FINGERPRINTED = ("build.py", "config.py", "device_code.py", "format_parts", "formats.py",
                 "kernels", "model.py", "params.py", "rope.py", "targets.py")


def source_fingerprint(root: Path, parts=FINGERPRINTED) -> str:
    """sha256 (16 hex) of the ``*.py`` files under ``root`` named by ``parts`` (files or
    folders, taken recursively), each with its path relative to ``root``."""
    h = hashlib.sha256()
    for part in parts:
        base = root / part
        for path in sorted(base.rglob("*.py")) if base.is_dir() else [base]:
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def compiler_fingerprint() -> str:
    """The fingerprint of this installation's :data:`FINGERPRINTED` modules: an edited kernel is
    a new key even before the package version changes."""
    return source_fingerprint(Path(__file__).resolve().parent)


def key_fields(spec: BuildSpec, target: TargetSpec) -> dict[str, Any]:
    """Every input that changes the compiled library."""
    return {
        "model": spec.config.shape_dict(),
        "max_blocks_cap": spec.max_blocks_cap,
        "block_size": spec.block_size,
        "cache_dtype": spec.cache_dtype,
        "weight_dtype": spec.weight_dtype,
        "weight_formats": dict(spec.weight_formats),
        "batch_buckets": list(spec.batch_buckets),
        "target": target.key_string,
        "exec_mode": EXEC_MODE,
        "tvm_version": tvm.__version__,
        "package_version": PACKAGE_VERSION,
        "abi_version": ABI_VERSION,
        "compiler": compiler_fingerprint(),
        "k_block_layout": kernels_for(target.kind).k_block_layout,
    }


def manifest_for(spec: BuildSpec, target: TargetSpec) -> dict[str, Any]:
    """The manifest minus the library hash and timing (also returned by ``_metadata()``)."""
    cfg = spec.config
    fields = key_fields(spec, target)
    return {
        "manifest_format": MANIFEST_FORMAT,
        "name": cfg.name,
        "key": fields,
        "digest": key_digest(fields),
        "target_kind": target.kind,
        "library": target.library_name,
        "link_note": target.link_note,
        "n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_blocks_cap": spec.max_blocks_cap, "block_size": spec.block_size,
        "cache_dtype": spec.cache_dtype, "weight_dtype": spec.weight_dtype,
        "k_block_layout": fields["k_block_layout"],
        "batch_buckets": list(spec.batch_buckets),
        "params": [[s.name, list(s.shape), s.dtype] for s in spec.param_specs()],
        "functions": ((["decode", "prefill", "_metadata"] if target.kind in NO_INT64_BUFFERS
                       else ["decode", "decode_dev", "prefill", "_metadata"])
                      + [f"batch_decode_{b}" for b in spec.batch_buckets]),
    }


def _export(ex, lib_path: Path, target: TargetSpec) -> None:
    """export_library; for CUDA with the device code compiled by nvcc and embedded (a fatbin
    for the target's arch), so the loading machine needs no CUDA compiler or NVRTC."""
    if target.kind == "cuda":
        ex.export_library(str(lib_path), fpack_imports=fatbin_packer(target.arch))
    else:  # model.tar for metal / webgpu: host object + device module, linked on the target
        ex.export_library(str(lib_path))


@tvm.transform.module_pass(opt_level=0, name="MarkAllNoAlias")
def _mark_all_noalias(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Give every PrimFunc ``tirx.noalias``.  LLVM codegen drops the no-alias assumption for the
    whole module when one function lacks it, and the shape functions Relax generates do: that
    made the hand-scheduled kernels 3-4x slower inside the model than alone (acc buffers no
    longer kept in registers).  Shape functions only touch their own heap buffer."""
    funcs = {gv: (f.with_attr("tirx.noalias", True) if isinstance(f, tvm.tirx.PrimFunc) else f)
             for gv, f in mod.functions.items()}
    return tvm.IRModule(funcs, attrs=mod.attrs, global_infos=mod.global_infos)


def relax_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's default Relax pipeline for the target, then :func:`_mark_all_noalias`."""
    if "gpu" in target.keys:
        base = relax.get_default_pipeline(target)
    else:
        base = relax.get_pipeline("default")
    return tvm.transform.Sequential([base, _mark_all_noalias])


# what a compile says before each of its steps (the second takes most of the time)
STAGES = ("writing the kernels and the graph", "optimising and generating machine code",
          "linking the library")


# the reporter of the build in progress: set by build_into around compile_library, whose
# four-argument signature is what callers that wrap or replace it rely on
_STAGE: contextvars.ContextVar = contextvars.ContextVar("stage", default=None)


def compile_library(spec: BuildSpec, target: TargetSpec, manifest: dict, out_dir: Path) -> Path:
    """Build and export the library into ``out_dir``; returns its path.  The ``stage`` given
    to :func:`build_into` is told ``(i, n, what)`` before each of the steps of :data:`STAGES`."""
    say = _STAGE.get() or (lambda _i, _n, _what: None)
    missing = target.missing_toolchain()
    if missing:
        raise CompileError(f"cannot build {spec.config.name} for {target.name or target.kind}: "
                           f"{missing}")
    try:
        say(1, len(STAGES), STAGES[0])
        mod = build_module(spec, manifest, kernels_for(target.kind, target.target))
        say(2, len(STAGES), f"{STAGES[1]} ({target.kind}, {len(manifest['functions'])} "
            "functions)")
        with (cuda_compile_callback(target.arch) if target.kind == "cuda"
              else contextlib.nullcontext()):
            ex = relax.build(mod, target.target, relax_pipeline=relax_pipeline(target.target),
                             exec_mode=EXEC_MODE)
        lib_path = out_dir / target.library_name
        say(3, len(STAGES), STAGES[2])
        _export(ex, lib_path, target)
    except (tvm.error.InternalError, RuntimeError, ValueError) as e:
        raise CompileError(f"TVM failed to build {spec.config.name} for {target.kind}: {e}") from e
    except OSError as e:  # export_library writes the .so (disk full, read-only root)
        raise CompileError(f"could not write the library into {out_dir} ({e}); free disk space "
                           "or choose another --artifacts root") from e
    return lib_path


def build_into(spec: BuildSpec, target: TargetSpec, out_dir: Path, model_arg: str = "",
               stage: Callable[[int, int, str], None] | None = None,
               twin: Path | None = None) -> dict:
    """Compile into ``out_dir`` and write manifest.json (last, so its presence means complete).
    ``model_arg`` (what ``--model`` takes to name the model again) goes into the manifest only,
    for the rebuild hints: it is not part of the key.  ``stage``: see :func:`compile_library`.
    ``twin``: a complete artifact of the same key under another model name, whose library is
    this one's (the name is not in the key): linked or copied instead of compiled."""
    manifest = manifest_for(spec, target)
    t0 = time.perf_counter()
    lib_path = _library_of(twin, out_dir, target) if twin is not None else None
    if lib_path is not None:
        log.info("%s for %s (key %s): the library of %s, same key", spec.config.name,
                 target.kind, manifest["digest"], twin.name)
    else:
        log.info("compiling %s for %s (key %s)", spec.config.name, target.kind,
                 manifest["digest"])
        token = _STAGE.set(stage)
        try:
            lib_path = compile_library(spec, target, manifest, out_dir)
        finally:
            _STAGE.reset(token)
    manifest["compile_seconds"] = round(time.perf_counter() - t0, 3)
    if model_arg:
        manifest["model_arg"] = model_arg
    try:
        manifest["library_sha256"] = sha256_file(lib_path)
        manifest["library_bytes"] = lib_path.stat().st_size
        (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    except OSError as e:
        raise CompileError(f"could not write the manifest into {out_dir} ({e}); free disk space "
                           "or choose another --artifacts root") from e
    return manifest


def _library_of(twin: Path, out_dir: Path, target: TargetSpec) -> Path | None:
    """``twin``'s library in ``out_dir`` (a hard link where the file system allows, else a
    copy), or None if it cannot be had (gone meanwhile, no room): then it is compiled."""
    src, dst = twin / target.library_name, out_dir / target.library_name
    try:
        os.link(src, dst)
    except OSError:
        try:
            shutil.copyfile(src, dst)
        except OSError:
            dst.unlink(missing_ok=True)
            return None
    return dst
