"""Version constants shared by the build side and the loader (both must agree to load)."""

from importlib import metadata

try:
    PACKAGE_VERSION = metadata.version("paged-decode")  # pyproject.toml's, as installed
except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    PACKAGE_VERSION = "0+source"
# Bump when the compiled functions' signatures, the params layout or the manifest format change.
ABI_VERSION = 5  # 5: batch_decode_<B> functions (manifest batch_buckets)
MANIFEST_FORMAT = 2  # 2: batch_buckets
WEIGHTS_FORMAT = 4  # 4: weights.json carries meta_sha256 over its own fields


def key_digest(fields: dict) -> str:
    """sha256 of the sorted JSON of the key fields, 16 hex chars (artifact folder suffix)."""
    import hashlib
    import json

    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
