"""``manifest.json`` parsed once into a frozen :class:`Manifest`.

The build side writes the manifest (``compile/build.py: manifest_for``) and the library reports
the same fields through ``_metadata()``; the loader checks both and then reads attributes only.
A missing field, an unknown one or a value of the wrong type is an ``ArtifactError`` naming the
field, so a damaged or foreign manifest never reaches a kernel call as a ``KeyError``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .checks import is_int
from .errors import ArtifactError
from .kv_pool import CACHE_DTYPES, K_BLOCK_LAYOUTS


def _positive(v) -> bool:
    return is_int(v) and v > 0


def _text(v) -> bool:
    return isinstance(v, str) and bool(v)


def _param(v) -> bool:
    """``[name, shape, dtype]`` as the weight pack lists it."""
    return (isinstance(v, list) and len(v) == 3 and _text(v[0]) and _text(v[2])
            and isinstance(v[1], list) and all(is_int(d) and d >= 0 for d in v[1]))


# field -> (rule as the error states it, check); the order is the dataclass's
_RULES = {
    "manifest_format": ("a positive integer", _positive),
    "name": ("a non-empty string", _text),
    "key": ("an object", lambda v: isinstance(v, dict)),
    "digest": ("a non-empty string", _text),
    "target_kind": ("a non-empty string", _text),
    "library": ("a file name inside the artifact folder",
                lambda v: _text(v) and "/" not in v and v not in (".", "..")),
    "link_note": ("a string", lambda v: isinstance(v, str)),
    "n_layers": ("a positive integer", _positive),
    "n_kv_heads": ("a positive integer", _positive),
    "head_dim": ("a positive integer", _positive),
    "vocab_size": ("a positive integer", _positive),
    "max_blocks_cap": ("a positive integer", _positive),
    "block_size": ("a positive integer", _positive),
    "cache_dtype": (f"one of {list(CACHE_DTYPES)}", lambda v: v in CACHE_DTYPES),
    "weight_dtype": ("a non-empty string", _text),
    "k_block_layout": (f"one of {list(K_BLOCK_LAYOUTS)}", lambda v: v in K_BLOCK_LAYOUTS),
    "batch_buckets": ("a sorted list of distinct integers >= 2",
                      lambda v: isinstance(v, list) and all(is_int(b) and b >= 2 for b in v)
                      and v == sorted(set(v))),
    "params": ("a list of [name, shape, dtype]",
               lambda v: isinstance(v, list) and all(_param(p) for p in v)),
    "functions": ("a list of function names",
                  lambda v: isinstance(v, list) and all(_text(f) for f in v)),
    # written beside the library after the build (the library cannot report them)
    "compile_seconds": ("a non-negative number",
                        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                        and v >= 0),
    "library_sha256": ("64 hex digits", lambda v: isinstance(v, str) and len(v) == 64),
    "library_bytes": ("a positive integer", _positive),
}
# the batch buckets an artifact gets unless told, on every target whose kernel set batches
# (all but WebGPU: compile/api.py default_buckets)
DEFAULT_BATCH_BUCKETS = (2, 4, 8, 16, 32)
# a stored format's name ends in this where its rows are interleaved in groups (the CPU's
# layout of q8_0 / q4_0 / q4_1 / q5_0 / q5_1 / q4_k / q5_k / q6_k; compile/formats.py): the same format to whoever
# chooses it
INTERLEAVED_SUFFIX = "x8"
# --weight-dtype's llama.cpp k-quant mixes and the k-quant each is made of (with Q6_K)
K_QUANT_MIXES = {"q4_k_m": "q4_k", "q5_k_m": "q5_k"}
# a k-quant policy's format for a matrix whose rows are not whole 256-weight super-blocks
# (SmolLM2's 576): the 32-weight format of at least its precision (llama.cpp falls back to
# Q5_0 / Q5_1 / Q8_0 there, the first two not run here)
K_QUANT_FALLBACKS = {"q4_k": "q4_1", "q5_k": "q8_0", "q6_k": "q8_0"}


def weight_policy(weight_dtype, weight_formats, model: str | None = None) -> str:
    """The ``--weight-dtype`` that chooses these formats again: their one format (interleaved
    or not; a quantized format's LM head, or tied embedding, in Q8_0 is that format's own
    choice); for a model that is not a GGUF (``model``, what ``--model`` took, not ending in
    .gguf), a k-quant with the formats its rows fall back to, or llama.cpp's mix "q4_k_m" /
    "q5_k_m"; else "auto" (a GGUF's own mix).  Damaged values (from a file) give "auto"."""
    try:
        formats = dict(weight_formats or {})
    except (TypeError, ValueError):
        formats = {}
    names = {f.removesuffix(INTERLEAVED_SUFFIX) for name, f in formats.items()
             if isinstance(f, str) and not (name in ("embed", "lm_head")
                                            and f.removesuffix(INTERLEAVED_SUFFIX) == "q8_0")}
    if isinstance(weight_dtype, str):
        names.add(weight_dtype.removesuffix(INTERLEAVED_SUFFIX))
    if len(names) == 1:
        return names.pop()
    if model is None or str(model).lower().endswith(".gguf"):
        return "auto"
    policies = {k: {k} for k in K_QUANT_FALLBACKS}
    policies.update({mix: {base, "q6_k", "q5_k"} for mix, base in K_QUANT_MIXES.items()})

    def present(fmt):  # the format, or what its rows fell back to
        return fmt in names or K_QUANT_FALLBACKS[fmt] in names

    for policy, made in policies.items():  # single k-quants first: a mix has Q6_K as well
        allowed = made | {K_QUANT_FALLBACKS[f] for f in made}
        if names <= allowed and present(K_QUANT_MIXES.get(policy, policy)) and (
                policy in K_QUANT_FALLBACKS or present("q6_k")):
            return policy
    return "auto"


# fields the manifest on disk holds and the library's ``_metadata()`` does not: the model's name
# is not in the key either, so one library serves every model folder of its key
DISK_ONLY = ("compile_seconds", "library_sha256", "library_bytes", "model_arg", "name")
_OPTIONAL = {"model_arg": ("a string", lambda v: isinstance(v, str))}


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What an artifact was built as (shapes, dtypes, layout, functions) and how to verify it.

    ``params`` is ``((name, shape, dtype), ...)`` in the order the compiled functions take
    them; ``key`` the artifact key fields whose digest is ``digest``.
    """

    manifest_format: int
    name: str
    key: dict
    digest: str
    target_kind: str
    library: str
    link_note: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_blocks_cap: int
    block_size: int
    cache_dtype: str
    weight_dtype: str
    k_block_layout: str
    batch_buckets: tuple
    params: tuple
    functions: tuple
    compile_seconds: float
    library_sha256: str
    library_bytes: int
    model_arg: str | None = None

    @classmethod
    def parse(cls, data: dict, path: Path | str, hint: str) -> "Manifest":
        """Check every field of ``data`` (a manifest.json object read from ``path``); the
        error names the field, its value and the rule, then ``hint`` (how to rebuild)."""
        where = f"{path}: manifest.json"
        if not isinstance(data, dict):
            raise ArtifactError(f"{where} holds a {type(data).__name__}, not an object; {hint}")
        unknown = sorted(set(data) - set(_RULES) - set(_OPTIONAL))
        if unknown:
            raise ArtifactError(f"{where} has unknown field {unknown[0]!r} (this runtime reads "
                                f"{sorted(_RULES)}); {hint}")
        for field, (rule, ok) in {**_RULES, **_OPTIONAL}.items():
            if field not in data:
                if field in _OPTIONAL:
                    continue
                raise ArtifactError(f"{where} lacks field {field!r}; {hint}")
            if not ok(data[field]):
                raise ArtifactError(f"{where} field {field}={data[field]!r}: must be {rule}; "
                                    f"{hint}")
        values = dict(data)
        values["params"] = tuple((n, tuple(s), d) for n, s, d in data["params"])
        values["functions"] = tuple(data["functions"])
        values["batch_buckets"] = tuple(data["batch_buckets"])
        return cls(**values)

    def to_dict(self) -> dict:
        """The JSON object this manifest was parsed from (lists where JSON has them)."""
        d = dataclasses.asdict(self)
        d["params"] = self.param_layout
        d["functions"] = list(self.functions)
        d["batch_buckets"] = list(self.batch_buckets)
        if self.model_arg is None:
            del d["model_arg"]
        return d

    @property
    def max_tokens(self) -> int:
        """Tokens one sequence can hold: ``max_blocks_cap * block_size``."""
        return self.max_blocks_cap * self.block_size

    @property
    def param_layout(self) -> list:
        """``params`` as weights.json lists them (``[[name, [shape], dtype], ...]``)."""
        return [[n, list(s), d] for n, s, d in self.params]
