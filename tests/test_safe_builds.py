"""Builds are safe to race between processes and to kill: one compile, nothing half-built kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paged_decode.compile import api, cache
from paged_decode.runtime.artifact import load_artifact, load_weights
from paged_decode.runtime.errors import ArtifactError

from .conftest import copying_compiles

OPTS = dict(block_size=4, max_context=64, batch_buckets=())  # as the session's `build`

# argv: root, marker file (one line per compile), ready file, go file
RACER = f"""
import json, os, sys, time
from pathlib import Path
from paged_decode.compile import api, build
from paged_decode.runtime.artifact import load_artifact, load_weights
root, marker, ready, go = sys.argv[1:5]
real = build.compile_library
def counting(*args):
    with open(marker, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    return real(*args)
build.compile_library = counting
Path(ready).write_text("ready")
while not Path(go).exists():
    time.sleep(0.01)
p = api.prepare("tiny", artifacts=root, **{OPTS!r})
load_weights(p.weights_dir, load_artifact(p.artifact_dir))
print(json.dumps({{"cache_hit": p.cache_hit, "dir": str(p.artifact_dir)}}))
"""

# argv: root, started file.  Writes a partial model.so, then hangs until killed.
KILLED = f"""
import sys, time
from pathlib import Path
from paged_decode.compile import api, build
root, started = sys.argv[1:3]
def partial(spec, target, manifest, out_dir):
    (out_dir / "model.so").write_bytes(b"\\x7fELF" + bytes(4096))
    Path(started).write_text(str(out_dir))
    time.sleep(120)
build.compile_library = partial
api.prepare("tiny", artifacts=root, **{OPTS!r})
"""


def _spawn(script: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"child exited early ({proc.returncode}): {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"child did not write {path}"
        time.sleep(0.05)


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def test_two_processes_building_one_key_compile_once(tmp_path):
    root, marker, go = tmp_path / "root", tmp_path / "compiles", tmp_path / "go"
    procs = [_spawn(RACER, root, marker, tmp_path / f"ready{i}", go) for i in range(2)]
    for i, proc in enumerate(procs):
        _wait_for(tmp_path / f"ready{i}", proc)
    go.write_text("go")  # both start prepare() at once
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len(marker.read_text().splitlines()) == 1
    assert sorted(r["cache_hit"] for r in results) == [False, True]
    assert len({r["dir"] for r in results}) == 1
    assert _entries(root) == sorted([Path(results[0]["dir"]).name, "weights"])
    assert list((root / ".tmp").iterdir()) == []


def test_killed_build_leaves_nothing_loadable_and_a_later_build_succeeds(build, tmp_path,
                                                                         monkeypatch):
    """The later build's compile copies the library the session built for this key (the
    compile itself: test_two_processes_building_one_key_compile_once)."""
    built = build("tiny", **OPTS)
    root, started = tmp_path / "root", tmp_path / "started"
    proc = _spawn(KILLED, root, started)
    try:
        _wait_for(started, proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    partial = Path(started.read_text())
    assert partial.parent == root / ".tmp" and f"-{proc.pid}-" in partial.name
    assert (partial / "model.so").exists() and not (partial / "manifest.json").exists()
    assert _entries(root) == []  # nothing renamed into place
    name = api.artifact_name(*_spec_and_target())
    for path, message in ((partial, "manifest.json is missing"),
                          (root / name, "no such artifact folder")):
        with pytest.raises(ArtifactError, match=message):
            load_artifact(path)
    with pytest.raises(ArtifactError, match="readonly; build it with: paged-compile"):
        api.prepare("tiny", artifacts=root, policy="readonly", **OPTS)

    copying_compiles(built, monkeypatch)
    prepared = api.prepare("tiny", artifacts=root, **OPTS)  # the dead builder's lock is free
    assert not prepared.cache_hit and prepared.artifact_dir == root / name
    assert not partial.exists()  # swept: its pid is gone
    load_weights(prepared.weights_dir, load_artifact(prepared.artifact_dir))


def _spec_and_target():
    from paged_decode.compile.targets import resolve_target
    from paged_decode.compile.weights import resolve_model

    tspec = resolve_target(None)
    return api._spec(resolve_model("tiny"), tspec, OPTS["block_size"], OPTS["max_context"], None,
                     "float32", "float32", OPTS["batch_buckets"]), tspec


def test_sweep_keeps_live_builders_and_foreign_names(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    tmp = tmp_path / ".tmp"
    for name in (f"m-llvm-0123-{dead_pid}-ab12", f"m-llvm-0123.old-{dead_pid}-cd34",
                 f"m-llvm-0123-{os.getpid()}-ef56", "not-a-build"):
        (tmp / name).mkdir(parents=True)
    swept = cache.sweep_stale(tmp)
    assert sorted(p.name for p in swept) == sorted([f"m-llvm-0123-{dead_pid}-ab12",
                                                    f"m-llvm-0123.old-{dead_pid}-cd34"])
    assert sorted(p.name for p in tmp.iterdir()) == sorted([f"m-llvm-0123-{os.getpid()}-ef56",
                                                            "not-a-build"])
