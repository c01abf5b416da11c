"""Artifact key, cache hits, concurrent builds and the embedded manifest."""

from __future__ import annotations

import dataclasses
import json
import platform
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from paged_decode.compile import api, build
from paged_decode.compile.build import key_fields, make_spec, manifest_for
from paged_decode.compile.config import preset
from paged_decode.compile.kernels.cpu.simd import K_BLOCK_LAYOUT
from paged_decode.compile.targets import resolve_target
from paged_decode.compile.weights import resolve_model
from paged_decode.runtime import artifact as artifact_module
from paged_decode.runtime.artifact import load_artifact, missing_cpu_features
from paged_decode.runtime.errors import ArtifactError
from paged_decode.runtime.versions import WEIGHTS_FORMAT, key_digest

from .conftest import BATCHED, LOGIT_TOL, copying_compiles


def _digest(cfg=None, target="llvm", **opts):
    base = dict(block_size=4, max_blocks_cap=8, cache_dtype="float32", weight_dtype="float32")
    base.update(opts)
    spec = make_spec(cfg or preset("tiny"), **base)
    return manifest_for(spec, resolve_target(target))["digest"]


def test_every_key_field_changes_the_digest(monkeypatch):
    cfg = preset("tiny")
    base = _digest()
    variants = {
        "hidden_size": _digest(dataclasses.replace(cfg, hidden_size=96)),
        "rope_theta": _digest(dataclasses.replace(cfg, rope_theta=5e5)),
        "tie": _digest(dataclasses.replace(cfg, tie_word_embeddings=True)),
        "max_blocks_cap": _digest(max_blocks_cap=9),
        "block_size": _digest(block_size=8),
        "cache_dtype": _digest(cache_dtype="float16"),
        "weight_dtype": _digest(weight_dtype="float16"),
        "target": _digest(target="llvm:skylake-avx512"),
    }
    assert base not in variants.values()
    assert len(set(variants.values())) == len(variants)
    for name, value in (("EXEC_MODE", "changed"), ("PACKAGE_VERSION", "changed"),
                        ("ABI_VERSION", "changed"), ("compiler_fingerprint", lambda: "changed")):
        with monkeypatch.context() as m:
            m.setattr(build, name, value)
            assert _digest() != base, name
    with monkeypatch.context() as m:
        m.setattr(build.tvm, "__version__", "0.0.0")
        assert _digest() != base


# what a user edits, as a path under the package root, and whether the artifact key must change
EDITS = {"compile/cache.py": False, "compile/api.py": False, "compile/weights.py": False,
         "compile/tokenizer_export.py": False, "bench/run.py": False, "bench/report.py": False,
         "cli.py": False, "compile/kernels/cpu/gemv.py": True,
         "compile/kernels/gpu/attention.py": True, "compile/kernels/common.py": True,
         "compile/model.py": True, "compile/params.py": True, "compile/formats.py": True,
         "compile/kernels/cpu/quant.py": True}


@pytest.mark.parametrize("rel", EDITS)
def test_the_compiler_fingerprint_covers_exactly_what_shapes_the_library(rel, tmp_path,
                                                                         monkeypatch):
    pkg = Path(build.__file__).resolve().parent.parent
    copy = tmp_path / "pkg"
    for part in ("compile", "bench"):
        shutil.copytree(pkg / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(pkg / "cli.py", copy / "cli.py")
    monkeypatch.setattr(build, "compiler_fingerprint",
                        lambda: build.source_fingerprint(copy / "compile"))
    assert build.source_fingerprint(copy / "compile") == build.source_fingerprint(pkg / "compile")
    before = _digest()
    with open(copy / rel, "a") as f:
        f.write("\n# an edit\n")
    assert (_digest() != before) == EDITS[rel]


def test_fields_cover_the_documented_key():
    fields = key_fields(make_spec(preset("tiny"), block_size=4, max_blocks_cap=8),
                        resolve_target(None))
    assert set(fields) == {"model", "max_blocks_cap", "block_size", "cache_dtype",
                           "weight_dtype", "target", "exec_mode", "tvm_version",
                           "package_version", "abi_version", "compiler", "k_block_layout",
                           "batch_buckets", "weight_formats"}
    assert "mcpu" in fields["target"]
    # the CPU kernels store K blocks [dim, slot], the GPU kernels [slot, dim]
    assert fields["k_block_layout"] == K_BLOCK_LAYOUT == "dim-major"
    gpu = key_fields(make_spec(preset("tiny"), block_size=4, max_blocks_cap=8),
                     resolve_target("cuda"))
    assert gpu["k_block_layout"] == "slot-major"


def test_weight_values_do_not_change_the_digest_but_change_shape_key(llama_ckpt, tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(llama_ckpt.path)
    with __import__("torch").no_grad():
        model.model.norm.weight.add_(1.0)
    model.save_pretrained(tmp_path)
    a, b = resolve_model(str(llama_ckpt.path)), resolve_model(str(tmp_path))
    assert _digest(a.config) == _digest(dataclasses.replace(b.config, name=a.config.name))
    assert api.shape_key(a, "float32") != api.shape_key(b, "float32")


def test_second_compile_of_a_key_compiles_nothing(build, tmp_path, monkeypatch):
    """Builds counted at ``build.compile_library``, which here copies the library the session
    built for this key (a real compile into a fresh root:
    test_concurrent_builds_of_one_key_leave_one_artifact)."""
    count = copying_compiles(build("tiny", block_size=4, max_context=64), monkeypatch)
    opts = dict(block_size=4, max_context=64, artifacts=tmp_path, batch_buckets=())
    first, second = api.prepare("tiny", **opts), api.prepare("tiny", **opts)
    assert (first.cache_hit, second.cache_hit, len(count)) == (False, True, 1)
    assert first.artifact_dir == second.artifact_dir
    api.prepare("tiny", force=True, **opts)
    assert len(count) == 2


def test_a_second_model_folder_of_a_built_key_reuses_its_library(build, llama_ckpt, tmp_path,
                                                                monkeypatch):
    """A fine-tune of a built model (the same config, other weights, another folder name) gets
    the built library (no compile), its own manifest name, and computes with its own weights.
    Builds are counted at ``compile_library``, which copies the base's library (the key's)."""
    import torch
    from transformers import LlamaForCausalLM

    from .test_runtime_hf import hf_reference, run_ours

    opts = BATCHED  # the batching tests' build of llama_ckpt: the session compiles it anyway
    base = build(llama_ckpt.path, **opts)
    model = LlamaForCausalLM.from_pretrained(llama_ckpt.path)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    tuned = tmp_path / "llama-tuned"
    model.save_pretrained(tuned)
    count = copying_compiles(base, monkeypatch)
    twin = api.prepare(str(tuned), artifacts=base.artifact_dir.parent, **opts)
    assert count == [] and not twin.cache_hit and twin.artifact_dir != base.artifact_dir
    mine, theirs = (json.loads((p / "manifest.json").read_text())
                    for p in (twin.artifact_dir, base.artifact_dir))
    assert (mine["name"], mine["library_sha256"]) == ("llama-tuned", theirs["library_sha256"])
    assert twin.artifact_dir.name.startswith("llama-tuned-")
    assert api.prepare(str(tuned), artifacts=base.artifact_dir.parent, **opts).cache_hit
    assert count == []
    artifact = load_artifact(twin.artifact_dir)
    logits, tokens = run_ours(artifact, artifact_module.load_weights(twin.weights_dir, artifact),
                              [3, 17, 99, 41, 5], 4)
    for ours, ref in zip(logits, hf_reference(tuned, [3, 17, 99, 41, 5], tokens)):
        np.testing.assert_allclose(ours, ref, atol=LOGIT_TOL["float32"], rtol=0)
    api.prepare(str(tuned), artifacts=base.artifact_dir.parent, force=True, **opts)
    assert len(count) == 1  # redo compiles


def test_weight_pack_of_an_older_format_is_converted_again(tmp_path):
    source = resolve_model("tiny")
    path, hit = api.ensure_weights(source, "float32", tmp_path, "on")
    assert not hit and api.ensure_weights(source, "float32", tmp_path, "on") == (path, True)
    meta = json.loads((path / "weights.json").read_text())
    (path / "weights.json").write_text(json.dumps({**meta, "weights_format": WEIGHTS_FORMAT - 1}))
    with pytest.raises(ArtifactError, match="paged-compile --model tiny"):
        api.ensure_weights(source, "float32", tmp_path, "readonly")
    assert api.ensure_weights(source, "float32", tmp_path, "on") == (path, False)
    assert json.loads((path / "weights.json").read_text())["weights_format"] == WEIGHTS_FORMAT


def test_concurrent_builds_of_one_key_leave_one_artifact(tmp_path, monkeypatch):
    count = []
    real = build.compile_library
    monkeypatch.setattr(build, "compile_library", lambda *a: count.append(1) or real(*a))
    results, errors = [], []

    def worker():
        try:
            results.append(api.prepare("tiny", block_size=8, max_context=16, artifacts=tmp_path,
                                       batch_buckets=()))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(count) == 1
    assert len({r.artifact_dir for r in results}) == 1
    assert sorted(r.cache_hit for r in results) == [False, True, True]
    entries = [p for p in tmp_path.iterdir() if not p.name.startswith(".") and p.name != "weights"]
    assert len(entries) == 1
    assert not any((tmp_path / ".tmp").iterdir())


def test_metadata_returns_the_manifest(build):
    prepared = build("tiny", block_size=4, max_context=64)
    artifact = load_artifact(prepared.artifact_dir)
    embedded = json.loads(artifact.vm["_metadata"]())
    on_disk = json.loads((prepared.artifact_dir / "manifest.json").read_text())
    assert embedded["digest"] == on_disk["digest"] == key_digest(on_disk["key"])
    assert embedded["key"] == on_disk["key"]
    assert {k: on_disk[k] for k in embedded} == embedded  # disk adds hash, timing, --model
    assert set(on_disk) - set(embedded) == {"compile_seconds", "library_sha256", "library_bytes",
                                            "model_arg", "name"}  # the name: not in the key
    assert on_disk["model_arg"] == "tiny"


def test_missing_cpu_features_are_what_the_target_cpu_has_and_this_one_lacks():
    avx2_only = frozenset({"avx", "avx2", "fma", "f16c"})

    def llvm(mcpu):
        return json.dumps({"kind": "llvm", "mcpu": mcpu})

    # Zen 4: AVX-512 F / BW / DQ / VL / VNNI / BF16, no AVX-VNNI or FP16
    assert missing_cpu_features(llvm("znver4"), avx2_only) == [
        "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vnni", "avx512bf16"]
    assert missing_cpu_features(llvm("haswell"), avx2_only) == []
    assert missing_cpu_features(llvm("znver4"), None) == []  # no /proc/cpuinfo: not checked
    assert missing_cpu_features('{"kind":"cuda","arch":"sm_90"}', avx2_only) == []


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="the check compares x86 instruction sets")
def test_an_artifact_for_a_cpu_with_more_instructions_is_refused_before_it_loads(
        build, monkeypatch):
    """Its first such instruction would kill the process (SIGILL): the load refuses it with
    the command that compiles for this machine, and never loads the library."""
    prepared = build("tiny", block_size=4, max_context=64)
    monkeypatch.setattr(artifact_module, "host_cpu_flags", lambda: frozenset({"sse4_2"}))

    def no_load(path):
        raise AssertionError(f"{path} was loaded")

    monkeypatch.setattr(artifact_module.tvm.runtime, "load_module", no_load)
    with pytest.raises(ArtifactError, match=r"built for llvm:\S+, whose instructions avx\b.* "
                       r"this CPU lacks.*`paged-compile --model tiny --target llvm "):
        load_artifact(prepared.artifact_dir)


def test_bad_cache_options_are_config_errors():
    from paged_decode.runtime.errors import ConfigError

    for kwargs in (dict(block_size=0), dict(max_context=-1), dict(cache_dtype="bfloat16"),
                   dict(weight_dtype="int8"), dict(max_blocks_cap=4, max_context=16)):
        opts = dict(block_size=4, max_blocks_cap=None, max_context=16)
        opts.update(kwargs)
        with pytest.raises(ConfigError):
            make_spec(preset("tiny"), **opts)
