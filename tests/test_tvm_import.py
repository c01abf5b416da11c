"""The runtime-only ``import tvm`` (runtime/_tvm.py): the compiler's object types it cannot know
are answered from the registered type keys, never by a failed C++ lookup (each failure throws,
and the first throw has libbacktrace read every loaded library's debug information)."""

from __future__ import annotations

import json
import subprocess
import sys

from paged_decode.runtime._tvm import _known_types_only

# a fresh interpreter: count the type-key lookups that reach C++ and fail during the import
SCRIPT = """
import json, sys
sys.modules["torch"] = None  # as the runtime-only import hides it; keeps this test quick
from tvm_ffi import core
failed = []
c_lookup = core._object_type_key_to_index

def counting(type_key):
    index = c_lookup(type_key)
    if index is None:
        failed.append(type_key)
    return index

core._object_type_key_to_index = counting
from paged_decode.runtime import _tvm
from paged_decode.runtime._tvm import tvm
vm_class = tvm.runtime.vm.VirtualMachine.__name__
print(json.dumps({"runtime_only": _tvm.runtime_only(), "failed": failed, "vm": vm_class,
                  "restored": core._object_type_key_to_index is counting}))
"""


def test_runtime_only_import_makes_no_failed_type_lookup():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["runtime_only"] is True and result["vm"] == "VirtualMachine"
    assert result["failed"] == []  # e.g. script.PrinterConfig, ir.IRModule without the guard
    assert result["restored"] is True  # the lookup is tvm_ffi's own again after the import


def test_known_types_only_asks_the_lookup_for_registered_keys_only():
    registered, asked = {"runtime.Module": 7}, []

    def lookup(type_key):
        asked.append(type_key)
        return registered[type_key]  # an unknown key would throw here, as in C++

    guarded = _known_types_only(lookup, lambda: list(registered))
    assert guarded("runtime.Module") == 7
    assert guarded("ir.IRModule") is None and asked == ["runtime.Module"]
    registered["ir.IRModule"] = 9  # a library loaded meanwhile registered it
    assert guarded("ir.IRModule") == 9 and asked == ["runtime.Module", "ir.IRModule"]
