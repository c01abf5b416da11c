"""The one place the runtime side imports TVM: ``from paged_decode.runtime._tvm import tvm``.

A process that has not loaded the build side loads TVM's runtime library only
(``libtvm_runtime.so``, 3 MB, instead of the 259 MB ``libtvm_compiler.so``), and without the
optional imports of ``tvm_ffi`` / ``tvm.runtime`` that the runtime never uses: torch (imported
whenever it is installed; the runtime never hands TVM a torch tensor) and ml_dtypes (bfloat16
and float8 arrays; the runtime's tensors are float32 / float16 / integers).  Together that is
about 5 s and 300 MB of every ``paged-run`` / ``paged-serve`` start on a 2-core machine.

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
