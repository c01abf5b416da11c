"""A deploy box needs the TVM runtime, numpy and the artifact: runtime/ and serve/ never import
compile/; and the build side never imports the benchmark (its edits must not touch the artifact
key)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import paged_decode.compile as compile_pkg
import paged_decode.runtime as runtime_pkg
import paged_decode.serve as serve_pkg

RUNTIME_DIR = Path(runtime_pkg.__path__[0])
SERVE_DIR = Path(serve_pkg.__path__[0])
COMPILE_DIR = Path(compile_pkg.__path__[0])


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
    return names


def test_no_runtime_or_serve_module_imports_compile():
    files = list(RUNTIME_DIR.glob("*.py")) + list(SERVE_DIR.glob("*.py"))
    offenders = {f"{p.parent.name}/{p.name}": sorted(n for n in _imports(p) if "compile" in n)
                 for p in files}
    assert len(offenders) > 20 and "serve/app.py" in offenders
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_compile_module_imports_the_benchmark():
    offenders = {str(p.relative_to(COMPILE_DIR)): sorted(n for n in _imports(p) if "bench" in n)
                 for p in COMPILE_DIR.rglob("*.py")}
    assert len(offenders) > 20  # every module of the build side was read
    assert {k: v for k, v in offenders.items() if v} == {}


def test_decode_from_an_artifact_loads_nothing_of_compile(build):
    """Load, decode and generate in a fresh interpreter; then list what got imported."""
    prepared = build("tiny", block_size=4, max_context=64)
    script = f"""
import json, sys
from paged_decode.runtime.engine import Engine
engine = Engine.load({str(prepared.artifact_dir)!r}, {str(prepared.weights_dir)!r})
tokens = engine.generator.generate([1, 2, 3], 5)
maps = open("/proc/self/maps").read()
print(json.dumps({{"tokens": tokens,
                  "compile": sorted(m for m in sys.modules if m.startswith("paged_decode.compile")),
                  "transformers": "transformers" in sys.modules,
                  "torch": sys.modules.get("torch") is not None,
                  "compiler_lib": "libtvm_compiler" in maps}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["tokens"]) == 5
    assert result["compile"] == [] and result["transformers"] is False
    # the runtime side loads TVM's runtime library only, without tvm_ffi's optional torch
    assert result["torch"] is False and result["compiler_lib"] is False
