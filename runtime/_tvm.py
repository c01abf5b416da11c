"""The one place the runtime side imports TVM: ``from paged_decode.runtime._tvm import tvm``.

A process that has not loaded the build side loads TVM's runtime library only
(``libtvm_runtime.so``, 3 MB, instead of the 259 MB ``libtvm_compiler.so``), and without the
optional imports of ``tvm_ffi`` / ``tvm.runtime`` that the runtime never uses: torch (imported
whenever it is installed; the runtime never hands TVM a torch tensor) and ml_dtypes (bfloat16
and float8 arrays; the runtime's tensors are float32 / float16 / integers).  Together that is
about 5 s and 300 MB of every ``paged-run`` / ``paged-serve`` start on a 2-core machine.

``import tvm`` also registers Python classes for the compiler's object types (``tvm.ir``,
``tvm.tirx``, the script printer, ...).  Without the compiler those types are unknown, and
``tvm_ffi`` learns that from a C++ lookup that fails by throwing: the first such throw builds a
C++ backtrace, which has libbacktrace read the debug information of every loaded library
(0.2 s and 33 MiB of resident memory, kept for the life of the process).  The runtime-only
import answers those lookups from the list of registered type keys instead
(:func:`_known_types_only`), so nothing throws.

A process that needs the compiler imports the build side (``paged_decode.compile``) first, or
sets ``TVM_USE_RUNTIME_LIB=0``; the choice is made at the first ``import tvm`` of the process and
holds for its life (:func:`require_compiler` names the fix when it came out wrong).  An explicit
``TVM_USE_RUNTIME_LIB`` in the environment always wins.
"""

from __future__ import annotations

import contextlib
import os
import sys

RUNTIME_ONLY_ENV = "TVM_USE_RUNTIME_LIB"
# optional imports of tvm_ffi / tvm.runtime (each guarded by `except ImportError`)
UNUSED_OPTIONAL = ("torch", "ml_dtypes")


def _build_side_loaded() -> bool:
    return any(name == "paged_decode.compile" or name.startswith("paged_decode.compile.")
               for name in sys.modules)


def _known_types_only(lookup, registered):
    """``lookup`` (type key -> type index, throwing in C++ for an unknown key) answering None
    for a key absent from ``registered()`` (the registered keys, read again on each miss since
    a library loaded meanwhile may have added some) without calling ``lookup``."""
    known: set[str] = set()

    def lookup_known(type_key):
        if type_key not in known:
            known.update(str(k) for k in registered())
            if type_key not in known:
                return None
        return lookup(type_key)

    return lookup_known


@contextlib.contextmanager
def _no_failed_type_lookups():
    """``tvm_ffi``'s type-key lookup answers unknown keys without a C++ throw while the block
    runs (see the module's docstring); unchanged where this ``tvm_ffi`` lacks the two hooks."""
    import tvm_ffi
    from tvm_ffi import core

    lookup = getattr(core, "_object_type_key_to_index", None)
    registered = tvm_ffi.get_global_func("ffi.GetRegisteredTypeKeys", allow_missing=True)
    if lookup is None or registered is None:
        yield
        return
    core._object_type_key_to_index = _known_types_only(lookup, registered)
    try:
        yield
    finally:
        core._object_type_key_to_index = lookup


@contextlib.contextmanager
def _runtime_only_import():
    """Set the runtime-only switch and hide :data:`UNUSED_OPTIONAL` for the first ``import tvm``
    only: the environment is restored afterwards so child processes (a compile) still get the
    compiler, and the hidden modules stay importable for code that wants them later."""
    os.environ[RUNTIME_ONLY_ENV] = "1"
    hidden = [name for name in UNUSED_OPTIONAL if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # an `import name` now fails at once with ImportError
    try:
        with _no_failed_type_lookups():
            yield
    finally:
        os.environ.pop(RUNTIME_ONLY_ENV, None)
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


if "tvm" in sys.modules or RUNTIME_ONLY_ENV in os.environ or _build_side_loaded():
    import tvm
else:
    with _runtime_only_import():
        import tvm
        import tvm.runtime.vm  # noqa: F401  (VirtualMachine: the one class the loader needs)


def runtime_only() -> bool:
    """True when this process's TVM has no compiler (``tvm.relax`` does not import)."""
    from tvm.base import _RUNTIME_ONLY

    return bool(_RUNTIME_ONLY)


def require_compiler() -> None:
    """Raise :class:`CompileError` naming the fix when this process loaded TVM's runtime
    library only (the runtime side was imported before the build side)."""
    if runtime_only():
        from .errors import CompileError

        raise CompileError("TVM's compiler is not loaded in this process: paged_decode.runtime "
                           "was imported before paged_decode.compile, which loads TVM's runtime "
                           "library only; import paged_decode.compile first, or set "
                           f"{RUNTIME_ONLY_ENV}=0 in the environment")


__all__ = ["tvm", "runtime_only", "require_compiler", "RUNTIME_ONLY_ENV"]
