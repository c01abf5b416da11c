"""Host memory for weights and KV pools (runtime/host_memory.py) and the weight-pack reader.

The reader is checked against the ``safetensors`` package's own reader (an independent
implementation of the format); damaged files must be a ``WeightsError``, never a crash or a
silently short tensor.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from paged_decode.runtime.artifact import load_artifact, load_weights
from paged_decode.runtime.errors import WeightsError
from paged_decode.runtime import host_memory
from paged_decode.runtime.host_memory import (ALIGN, HUGE_MIN, HUGE_PAGE, HostArena,
                                              release_free_heap, to_tvm)

from .conftest import make_pool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _smaps_field(address: int, field: str) -> list[str]:
    """The values of ``field`` (``VmFlags``, ``Rss``, ...) of the mapping of this process that
    holds ``address`` (Linux smaps)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            mapping = lo <= address < hi
        elif line.startswith(field + ":") and mapping:
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    return _smaps_field(address, "VmFlags")


def _resident_kib(address: int) -> int:
    """Rss of the mapping of this process that holds ``address``."""
    return int(_smaps_field(address, "Rss")[0])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def test_arena_slices_are_zeroed_page_aligned_and_disjoint():
    specs = [((3, 5), "float32"), ((4097,), "uint8"), ((2, 2, 2), "float16")]
    arena = HostArena.for_arrays(specs)
    arrays = [arena.take(shape, dtype) for shape, dtype in specs]
    for a, (shape, dtype) in zip(arrays, specs):
        assert a.shape == shape and a.dtype == np.dtype(dtype)
        assert _address(a) % ALIGN == 0
        assert not a.any()
        a[...] = 7
    spans = sorted((_address(a), _address(a) + a.nbytes) for a in arrays)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all((a == 7).all() for a in arrays)  # no slice overwrote another
    with pytest.raises(MemoryError, match=r"no room for \(1,\) float32"):
        arena.take((1,), "float32")


def test_tvm_tensor_shares_the_arena_memory():
    arena = HostArena([64])
    host = arena.take((16,), "float32")
    tensor = to_tvm(host)
    host[3] = 5.0
    assert tensor.numpy()[3] == 5.0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists(),
                    reason="transparent huge pages are a Linux feature; this kernel has none")
def test_arena_is_advised_for_huge_pages_and_starts_on_one():
    arena = HostArena([HUGE_MIN])
    host = arena.take((HUGE_MIN,), "uint8")
    assert _address(host) % (2 << 20) == 0
    assert "hg" in _vm_flags(_address(host))  # MADV_HUGEPAGE applied to this mapping


@pytest.mark.skipif(not THP.exists() or "[madvise]" not in THP.read_text(),
                    reason="huge pages are given on request only where the kernel's THP mode "
                    "is madvise (this kernel: none, or always / never)")
def test_a_small_arena_keeps_small_pages():
    """Under HUGE_MIN a huge page would be resident whole at its first write."""
    arena = HostArena([HUGE_MIN - ALIGN])
    host = arena.take((HUGE_MIN - ALIGN,), "uint8")
    assert "hg" not in _vm_flags(_address(host))
    # the kernel may merge the mapping with its neighbours: compare its resident size
    before = _resident_kib(_address(host))
    host[HUGE_PAGE - _address(host) % HUGE_PAGE] = 1  # a byte on a huge-page boundary
    assert _resident_kib(_address(host)) - before <= 64  # one 4 KiB page, not 2 MiB


def test_release_free_heap_returns_freed_heap_pages():
    """Freed small allocations stay in the C heap, resident, until trimmed (glibc)."""
    if host_memory._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    # blocks above pymalloc's 512 bytes and below malloc's mmap threshold: the C heap's
    keep = [bytes(2000) + bytes([i % 256]) for i in range(10_000)]  # 20 MB
    del keep[:-1]  # freed, but the top block keeps the heap from shrinking by itself
    before = _status_kib("RssAnon")
    release_free_heap()
    assert before - _status_kib("RssAnon") > 8 << 10


@pytest.fixture(scope="module")
def tiny(build):
    return build("tiny", block_size=4, max_context=64)


def test_weights_equal_the_safetensors_reader_and_live_in_one_arena(tiny):
    from safetensors.numpy import load_file

    artifact = load_artifact(tiny.artifact_dir)
    pack = load_weights(tiny.weights_dir, artifact)
    reference = load_file(str(tiny.weights_dir / "params.safetensors"))
    hosts = []
    for (name, shape, dtype), tensor in zip(artifact.manifest.params, pack.params):
        host = np.from_dlpack(tensor)
        np.testing.assert_array_equal(host, reference[name], err_msg=name)
        assert list(host.shape) == list(shape) and str(host.dtype) == dtype
        hosts.append(host)
    addresses = sorted(_address(h) for h in hosts)
    assert all(a % ALIGN == 0 for a in addresses)
    if THP.exists() and sys.platform.startswith("linux"):
        advised = HostArena.for_arrays([(h.shape, h.dtype) for h in hosts]).capacity >= HUGE_MIN
        assert all(("hg" in _vm_flags(a)) == advised for a in addresses)


@pytest.mark.parametrize("size", ["small", "huge"])
def test_pool_tensors_are_zeroed_arena_slices(tiny, size):
    """A pool's arena is advised for huge pages from HUGE_MIN bytes on."""
    artifact = load_artifact(tiny.artifact_dir)
    blocks = 8 if size == "small" else -(-HUGE_MIN // make_pool(artifact, 1).bytes_per_block)
    pool = make_pool(artifact, num_blocks=blocks)
    assert (pool.nbytes >= HUGE_MIN) == (size == "huge")
    for tensor in pool.pools:
        host = np.from_dlpack(tensor)
        assert _address(host) % ALIGN == 0 and not host.any()
        if THP.exists() and sys.platform.startswith("linux"):
            assert ("hg" in _vm_flags(_address(host))) == (size == "huge")


def _damage_header(pack: Path, edit) -> None:
    path = pack / "params.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n, "the edit must not lengthen the header"
    path.write_bytes(data[:8] + text + data[8 + n:])


def _first(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


DAMAGE = {
    "truncated data": (lambda p: p.write_bytes(p.read_bytes()[:-100]), r"\d+ data bytes"),
    "header longer than the file": (
        lambda p: p.write_bytes((1 << 40).to_bytes(8, "little") + p.read_bytes()[8:]),
        r"header of 1099511627776 bytes"),
    "too short for the length": (lambda p: p.write_bytes(b"\x01\x02"), r"shorter than the 8"),
    "header not JSON": (
        lambda p: p.write_bytes(p.read_bytes()[:8] + b"{" * 20 + p.read_bytes()[28:]),
        r"header is not JSON"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_weight_file_is_a_weights_error(tiny, tmp_path, damage):
    pack = Path(shutil.copytree(tiny.weights_dir, tmp_path / "pack"))
    spoil, message = DAMAGE[damage]
    spoil(pack / "params.safetensors")
    artifact = load_artifact(tiny.artifact_dir)
    with pytest.raises(WeightsError, match=r"params\.safetensors is missing or damaged"
                       rf".*{message}.*paged-compile --model tiny"):
        load_weights(pack, artifact)


@pytest.mark.parametrize("field,value,message", [
    ("data_offsets", [0, 4], r"do not hold"),
    ("dtype", "BF16", r"is not a supported tensor"),
    ("shape", [-1], r"is not a supported tensor"),
])
def test_bad_tensor_entry_is_a_weights_error(tiny, tmp_path, field, value, message):
    pack = Path(shutil.copytree(tiny.weights_dir, tmp_path / "pack"))
    _damage_header(pack, lambda h: _first(h).__setitem__(field, value))
    artifact = load_artifact(tiny.artifact_dir)
    with pytest.raises(WeightsError, match=rf"missing or damaged \(tensor \S+: .*{message}"):
        load_weights(pack, artifact)


def test_tensor_keeps_its_arena_alive():
    """The TVM tensor is the only reference left: the mapping must outlive the Python views."""
    import gc

    arena = HostArena([4 << 20])
    host = arena.take((1 << 20,), "float32")
    host[:] = np.arange(1 << 20, dtype=np.float32)
    tensor = to_tvm(host)
    del arena, host
    gc.collect()
    np.testing.assert_array_equal(tensor.numpy()[-3:], [(1 << 20) - 3, (1 << 20) - 2, (1 << 20) - 1])


def test_weights_that_do_not_fit_in_memory_are_a_weights_error(tiny, monkeypatch):
    from paged_decode.runtime import artifact as artifact_mod

    def refuse(_sizes):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(artifact_mod.HostArena, "for_arrays", staticmethod(refuse))
    artifact = load_artifact(tiny.artifact_dir)
    with pytest.raises(WeightsError, match=r"could not allocate \d+ bytes of host memory .*"
                       r"Cannot allocate memory"):
        load_weights(tiny.weights_dir, artifact)


def test_a_pool_larger_than_the_available_memory_is_refused_before_mapping(monkeypatch):
    """With overcommit a too-large mapping succeeds and the process is killed while it is zeroed:
    the arena refuses more than ``available_bytes()`` up front, and the pool says so."""
    from paged_decode.runtime import host_memory
    from paged_decode.runtime.kv_pool import PagedKVCache, PoolConfigError

    assert host_memory.available_bytes() > 0  # read from /proc/meminfo on Linux
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1 << 20)
    with pytest.raises(PoolConfigError, match=r"\(16777216 bytes in all: 16777216 bytes asked "
                       r"of host memory, 1048576 available\); lower num_blocks"):
        PagedKVCache(2, 4, 64, 16, "float32", num_blocks=256)
    PagedKVCache(2, 4, 64, 16, "float32", num_blocks=4)  # 256 KiB fits
