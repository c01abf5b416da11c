"""Loading verifies an artifact (versions, sha256, the library's own manifest); cache policies.

Every test works on a copy of the session's artifact (``shutil.copytree``), so the shared one
stays intact.  Policy tests replace the compiler by a copy of the already built library of the
same key: they count builds without paying for compiles.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from paged_decode.compile import api
from paged_decode.runtime.artifact import load_artifact, load_weights
from paged_decode.runtime.errors import ArtifactError, ConfigError
from paged_decode.runtime.versions import ABI_VERSION

from .conftest import BATCHED, copying_compiles

OPTS = dict(block_size=4, max_context=64, batch_buckets=())  # as the session's `build`
REBUILD = (r"paged-compile --model tiny --target llvm\S* --block-size 4 --max-blocks-cap 16 "
           r".*--force")


@pytest.fixture(scope="module")
def built(build):
    return build("tiny", **OPTS)


@pytest.fixture
def copy(built, tmp_path) -> Path:
    """A private copy of the artifact folder, under its own name."""
    return Path(shutil.copytree(built.artifact_dir, tmp_path / built.artifact_dir.name))


def _edit_manifest(path: Path, edit) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _truncate(path: Path) -> None:
    lib = path / "model.so"
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    lib = path / "model.so"
    data = bytearray(lib.read_bytes())
    data[len(data) // 3] ^= 0x01
    lib.write_bytes(bytes(data))


def _set_key(field, value):
    return lambda m: m["key"].__setitem__(field, value)


DAMAGE = {
    "truncated_library": (_truncate, r"model\.so: sha256 differs from the manifest"),
    "one_flipped_byte": (_flip_byte, r"model\.so: sha256 differs from the manifest"),
    "missing_library": (lambda p: (p / "model.so").unlink(), r"model\.so: library is missing"),
    "missing_manifest": (lambda p: (p / "manifest.json").unlink(), r"manifest\.json is missing"),
    "invalid_manifest": (lambda p: (p / "manifest.json").write_text("{not json"),
                         r"manifest\.json is not valid JSON"),
    "manifest_not_an_object": (lambda p: (p / "manifest.json").write_text("[1, 2]"),
                               r"manifest\.json holds a list, not an object"),
    "manifest_without_key": (lambda p: _edit_manifest(p, lambda m: m.pop("key")),
                             r"not an artifact manifest \(no key\)"),
    "key_edited_without_digest": (lambda p: _edit_manifest(p, _set_key("block_size", 8)),
                                  r"manifest key does not match its digest '[0-9a-f]{16}'"),
    "top_level_field_edited": (
        lambda p: _edit_manifest(p, lambda m: m.__setitem__("block_size", 8)),
        r"manifest field block_size=8 differs from the library's 4"),
    "other_tvm_version": (lambda p: _edit_manifest(p, _set_key("tvm_version", "0.19.0")),
                          r"built with tvm_version='0\.19\.0', this runtime has '0\.27"),
    "other_package_version": (lambda p: _edit_manifest(p, _set_key("package_version", "0.0.9")),
                              r"built with package_version='0\.0\.9'"),
    "other_abi_version": (lambda p: _edit_manifest(p, _set_key("abi_version", 0)),
                          rf"built with abi_version=0, this runtime has {ABI_VERSION}"),
    "other_manifest_format": (
        lambda p: _edit_manifest(p, lambda m: m.__setitem__("manifest_format", 99)),
        r"built with manifest_format=99"),
    "manifest_field_missing": (lambda p: _edit_manifest(p, lambda m: m.pop("n_kv_heads")),
                               r"manifest\.json lacks field 'n_kv_heads'"),
    "manifest_field_unknown": (
        lambda p: _edit_manifest(p, lambda m: m.__setitem__("n_experts", 8)),
        r"manifest\.json has unknown field 'n_experts'"),
    "manifest_field_a_string": (
        lambda p: _edit_manifest(p, lambda m: m.__setitem__("n_layers", "2")),
        r"field n_layers='2': must be a positive integer"),
    "manifest_field_a_bool": (
        lambda p: _edit_manifest(p, lambda m: m.__setitem__("vocab_size", True)),
        r"field vocab_size=True: must be a positive integer"),
    "manifest_library_outside": (
        lambda p: _edit_manifest(p, lambda m: m.__setitem__("library", "../model.so")),
        r"field library='\.\./model\.so': must be a file name inside the artifact folder"),
    "manifest_params_malformed": (
        lambda p: _edit_manifest(p, lambda m: m["params"][0].__setitem__(1, [-1])),
        r"field params=.*must be a list of \[name, shape, dtype\]"),
    "manifest_cache_dtype_unknown": (
        lambda p: _edit_manifest(p, lambda m: m.__setitem__("cache_dtype", "bfloat16")),
        r"field cache_dtype='bfloat16': must be one of \['float32', 'float16'\]"),
}


def test_an_intact_copy_loads(copy):
    artifact = load_artifact(copy)
    assert artifact.block_size == 4 and artifact.max_blocks_cap == 16


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_artifact_is_an_artifact_error_naming_the_rebuild(damage, copy):
    edit, reason = DAMAGE[damage]
    edit(copy)
    with pytest.raises(ArtifactError, match=reason) as info:
        load_artifact(copy)
    assert str(copy) in str(info.value)
    if damage.startswith(("missing_manifest", "invalid", "manifest_not")):
        assert "paged-compile --model tiny " in str(info.value)  # from the folder name
        assert "--force" in str(info.value)
    else:
        assert re.search(REBUILD, str(info.value)), str(info.value)


def test_library_of_another_key_is_refused(build, copy):
    """Another artifact's library with a consistent sha256: the _metadata() digest tells."""
    other = build("tiny", block_size=4, max_context=12)  # cap 3: test_session's build
    shutil.copy(other.artifact_dir / "model.so", copy / "model.so")
    sha = json.loads((other.artifact_dir / "manifest.json").read_text())["library_sha256"]
    _edit_manifest(copy, lambda m: m.__setitem__("library_sha256", sha))
    with pytest.raises(ArtifactError, match=r"library reports key '[0-9a-f]{16}', manifest says"):
        load_artifact(copy)


def test_weights_json_missing_is_a_weights_error(built, tmp_path):
    from paged_decode.runtime.errors import WeightsError

    pack = Path(shutil.copytree(built.weights_dir, tmp_path / "pack"))
    (pack / "params.safetensors").write_bytes(b"\0" * 16)
    artifact = load_artifact(built.artifact_dir)
    with pytest.raises(WeightsError, match=r"params\.safetensors is missing or damaged"):
        load_weights(pack, artifact)
    (pack / "weights.json").unlink()
    with pytest.raises(WeightsError, match=r"weights\.json is missing.*paged-compile --model tiny"):
        load_weights(pack, artifact)


def test_wrong_folders_say_which_folder_is_wanted(built, tmp_path):
    from paged_decode.runtime.errors import WeightsError

    with pytest.raises(ArtifactError, match=r"nope: no such artifact folder; pass the folder"):
        load_artifact(tmp_path / "nope")
    with pytest.raises(ArtifactError, match=r"is a weight pack, not an artifact folder"):
        load_artifact(built.weights_dir)  # the two paths swapped
    with pytest.raises(WeightsError, match=r"nope: no such weight pack folder"):
        load_weights(tmp_path / "nope", load_artifact(built.artifact_dir))
    with pytest.raises(WeightsError, match=r"not a weight pack folder"):
        load_weights(tmp_path, load_artifact(built.artifact_dir))
    root = built.artifact_dir.parent  # the cache root, not an artifact in it
    with pytest.raises(ArtifactError, match=r"is not an artifact folder .* it holds artifacts"):
        load_artifact(root)
    with pytest.raises(ArtifactError, match=r"is not an artifact folder .* pass the folder"):
        load_artifact(tmp_path)


# -- cache policies ------------------------------------------------------------------------------

@pytest.fixture
def compiles(built, monkeypatch) -> list:
    """Count builds; a "compile" copies the library already built for this key."""
    count = copying_compiles(built, monkeypatch)
    monkeypatch.delenv("PAGED_DECODE_CACHE", raising=False)
    return count


@pytest.fixture
def root(built, tmp_path) -> Path:
    """An artifact root holding copies of the built artifact and weight pack."""
    root = tmp_path / "root"
    shutil.copytree(built.artifact_dir, root / built.artifact_dir.name)
    shutil.copytree(built.weights_dir, root / "weights" / built.weights_dir.name)
    return root


def _prepare(root, **kwargs):
    return api.prepare("tiny", artifacts=root, **OPTS, **kwargs)


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_policy_on_reuses(root, compiles):
    prepared = _prepare(root, policy="on")
    assert prepared.cache_hit and prepared.weights_cache_hit and compiles == []


def test_policy_on_rebuilds_a_damaged_entry(root, compiles, built):
    _flip_byte(root / built.artifact_dir.name)
    prepared = _prepare(root, policy="on")
    assert not prepared.cache_hit and len(compiles) == 1
    load_artifact(prepared.artifact_dir)


def test_policy_readonly_with_nothing_built_names_the_command(tmp_path, compiles):
    with pytest.raises(ArtifactError, match=r"readonly; build it with: paged-compile --model "
                       r"tiny --target llvm:\S+ --block-size 4 --max-blocks-cap 16 --cache-dtype "
                       r"float32 --weight-dtype float32 --artifacts "):
        _prepare(tmp_path / "empty", policy="readonly")
    assert compiles == []
    assert _entries(tmp_path / "empty") == []


def test_policy_readonly_uses_what_is_there(root, compiles):
    before = _entries(root)
    prepared = _prepare(root, policy="readonly")
    assert prepared.cache_hit and compiles == [] and _entries(root) == before
    load_weights(prepared.weights_dir, load_artifact(prepared.artifact_dir))


def test_policy_readonly_refuses_a_damaged_entry(root, compiles, built):
    _truncate(root / built.artifact_dir.name)
    with pytest.raises(ArtifactError, match="missing or incomplete.*readonly"):
        _prepare(root, policy="readonly")
    assert compiles == []


def test_policy_off_keeps_nothing_in_the_root(tmp_path, compiles):
    root = tmp_path / "off"
    first = _prepare(root, policy="off")
    second = _prepare(root, policy="off")
    assert (first.cache_hit, second.cache_hit, len(compiles)) == (False, False, 2)
    assert _entries(root) == []
    assert root not in first.artifact_dir.parents and first.artifact_dir != second.artifact_dir
    load_weights(first.weights_dir, load_artifact(first.artifact_dir))


def test_policy_redo_rebuilds_and_replaces(root, compiles, built):
    entry = root / built.artifact_dir.name
    (entry / "marker").write_text("old entry")
    prepared = _prepare(root, policy="redo")
    assert not prepared.cache_hit and len(compiles) == 1
    assert prepared.artifact_dir == entry and not (entry / "marker").exists()
    assert _entries(root / ".tmp") == []
    load_artifact(entry)
    assert _prepare(root, force=True).cache_hit is False and len(compiles) == 2


@pytest.mark.parametrize("policy", ["readonly", "off", "redo", "on"])
def test_policy_from_the_environment(policy, tmp_path, compiles, monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_CACHE", policy)
    root = tmp_path / "env"
    if policy == "readonly":
        with pytest.raises(ArtifactError, match="readonly"):
            _prepare(root)
        assert compiles == []
    else:
        prepared = _prepare(root)
        assert not prepared.cache_hit and len(compiles) == 1
        assert (_entries(root) == []) == (policy == "off")
    assert _prepare(root, policy="off").cache_hit is False  # an explicit policy wins


def test_unknown_policy_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_DECODE_CACHE", "sometimes")
    with pytest.raises(ConfigError, match=r"cache policy 'sometimes'.*PAGED_DECODE_CACHE"):
        _prepare(tmp_path)


def test_rebuild_hints_name_the_model_as_it_was_given(build, llama_ckpt, tmp_path):
    """A readonly miss on a checkpoint folder names that folder's path as ``--model`` (not the
    model's name, which ``--model`` does not take).  A damaged artifact's hint names what
    ``--model`` took when it was built (a same-shaped checkpoint may have built it first), and
    that resolves to a model of the artifact's shape."""
    import shlex

    from paged_decode.compile.weights import resolve_model

    path = str(Path(llama_ckpt.path).resolve())
    want = re.escape(f"paged-compile --model {shlex.quote(path)} --target ")
    with pytest.raises(ArtifactError, match=want):
        api.prepare(str(llama_ckpt.path), artifacts=tmp_path / "empty", policy="readonly",
                    **BATCHED)
    built = build(llama_ckpt.path, **BATCHED)
    model_arg = built.manifest.model_arg
    assert resolve_model(model_arg).config.shape_dict() == built.manifest.key["model"]
    damaged = Path(shutil.copytree(built.artifact_dir, tmp_path / built.artifact_dir.name))
    _flip_byte(damaged)
    hinted = re.escape(f"paged-compile --model {shlex.quote(model_arg)} --target ")
    with pytest.raises(ArtifactError, match=hinted):
        load_artifact(damaged)


def test_the_default_models_rebuild_name_is_one_model_takes(smollm_gguf):
    """The default GGUF's own name ends in ``.Q4_1``; ``--model`` takes the default's name."""
    from paged_decode.compile.weights import DEFAULT_NAME, resolve_model

    source = resolve_model(None)
    assert source.cli_name == DEFAULT_NAME and source.config.name != DEFAULT_NAME
    assert resolve_model(source.cli_name).weights_key == source.weights_key
