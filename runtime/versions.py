"""Version constants shared by the build side and the loader (both must agree to load)."""

PACKAGE_VERSION = "0.1.0"
# Bump when the compiled functions' signatures, the params layout or the manifest format change.
ABI_VERSION = 1
MANIFEST_FORMAT = 1
WEIGHTS_FORMAT = 1
