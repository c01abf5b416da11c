"""CUDA device code compiled by nvcc at build time and embedded in the exported library.

How TVM 0.27 handles CUDA code: ``target.build.cuda`` emits CUDA C and hands it to the CUDA
runtime module factory.  Where the CUDA runtime plugin is loaded (a machine with a driver),
that factory compiles at once through the Python global ``tvm_callback_cuda_compile`` (NVRTC by
default, nvcc with ``TVM_CUDA_COMPILE_MODE=nvcc``); without it (a build machine with no GPU)
TVM keeps the *source* in the module, format ``"cuda"``, and the loading machine compiles it
through the same callback at load time, so it would need NVRTC or nvcc.

This module makes both cases ship compiled code for the target's architecture:

* ``cuda_compile_callback(arch)`` replaces the callback during the build, so a machine with the
  CUDA runtime compiles with nvcc for ``arch`` (TVM labels the result "cubin");
* ``fatbin_packer(arch)`` is export_library's ``fpack_imports`` hook: it takes TVM's serialized
  import blob, compiles every CUDA module still in source form with nvcc into a fatbin
  (``arch`` SASS plus PTX for newer GPUs), swaps it in with format ``"fatbin"`` and writes the
  blob as C for the final link.
* ``device_modules(lib)`` reads the blob back out of an exported ``.so`` (no TVM runtime, no GPU
  needed), so tests can check what a library carries.

The serialized module layout used here is TVM's: blob = ``u64 nbytes``, the import tree
(``vector<u64>`` row pointers, ``vector<u64>`` child indices), then per module a string kind
and, except for ``_lib``, its bytes; a CUDA module's bytes are ``fmt``, the function table,
then the code.  Strings and byte runs are ``u64 length`` + data, little-endian.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import subprocess
import tempfile
from pathlib import Path

from paged_decode.runtime.errors import CompileError

log = logging.getLogger(__name__)

FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
ELF_MAGIC = b"\x7fELF"
BLOB_SYMBOL = "__tvm_ffi__library_bin"
_NVCC_FLAGS = [
    "-O3", "--expt-relaxed-constexpr",
    # TVM's generated fp16 code relies on the half operators cuda_fp16.h hides by default
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
]  # no --use_fast_math: RoPE's sinf / cosf of large angles and expf must stay precise


def _gencode(arch: str) -> list[str]:
    """SASS for ``arch``; plus PTX the driver can JIT for newer GPUs (not for ``sm_XXa``)."""
    num = arch[3:]
    flags = ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    if not num[-1].isalpha():
        flags += ["-gencode", f"arch=compute_{num},code=compute_{num}"]
    return flags


def nvcc_fatbin(source: str, arch: str) -> bytes:
    """Compile CUDA C to a fatbin for ``arch`` with the nvcc on PATH."""
    with tempfile.TemporaryDirectory(prefix="paged-decode-nvcc-") as tmp:
        src, out = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.fatbin"
        src.write_text(source)
        cmd = ["nvcc", "--fatbin", *_gencode(arch), *_NVCC_FLAGS, "-o", str(out), str(src)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise CompileError(f"could not run nvcc ({e}); put the CUDA toolkit's bin/ on PATH")
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed for {arch} ({' '.join(cmd[:4])} ...):\n"
                               f"{proc.stdout}{proc.stderr}")
        data = out.read_bytes()
    if not data.startswith(FATBIN_MAGIC):
        raise CompileError(f"nvcc wrote {len(data)} bytes without the fatbin magic for {arch}")
    log.info("nvcc: %d bytes of %s fatbin", len(data), arch)
    return data


@contextlib.contextmanager
def cuda_compile_callback(arch: str):
    """While active, TVM's build-time CUDA compilation (machines with the CUDA runtime) uses
    nvcc for ``arch`` instead of NVRTC; the previous callback is restored afterwards."""
    import tvm_ffi

    name = "tvm_callback_cuda_compile"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)
    tvm_ffi.register_global_func(name, lambda code, *_: nvcc_fatbin(str(code), arch),
                                 override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)


# -- the serialized import blob ------------------------------------------------------------------
class _Reader:
    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return v

    def raw(self) -> bytes:
        n = self.u64()
        v = self.data[self.pos:self.pos + n]
        if len(v) != n:
            raise ValueError("truncated module blob")
        self.pos += n
        return v

    def u64s(self) -> list[int]:
        return [self.u64() for _ in range(self.u64())]


def _raw(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def parse_blob(blob: bytes) -> tuple[list[int], list[int], list[tuple[str, bytes | None]]]:
    """(row_ptr, child_indices, [(kind, payload or None for _lib)]) of a TVM import blob."""
    r = _Reader(blob)
    nbytes = r.u64()
    if nbytes + 8 > len(blob):
        raise ValueError(f"module blob claims {nbytes} bytes, holds {len(blob) - 8}")
    row_ptr, children = r.u64s(), r.u64s()
    modules = []
    for _ in range(len(row_ptr) - 1):
        kind = r.raw().decode()
        modules.append((kind, None if kind == "_lib" else r.raw()))
    return row_ptr, children, modules


def serialize_blob(row_ptr: list[int], children: list[int],
                   modules: list[tuple[str, bytes | None]]) -> bytes:
    body = b"".join([struct.pack("<Q", len(row_ptr)), *(struct.pack("<Q", v) for v in row_ptr),
                     struct.pack("<Q", len(children)), *(struct.pack("<Q", v) for v in children)])
    for kind, payload in modules:
        body += _raw(kind.encode()) + (b"" if payload is None else _raw(payload))
    return struct.pack("<Q", len(body)) + body


def cuda_payload_parts(payload: bytes) -> tuple[str, bytes, bytes]:
    """(fmt, function-table bytes, code) of a serialized CUDA module; the code is the last
    length-prefixed run, found by scanning for the prefix that reaches the end exactly."""
    r = _Reader(payload)
    fmt = r.raw().decode()
    start = r.pos
    for pos in range(len(payload) - 8, start - 1, -1):
        (n,) = struct.unpack_from("<Q", payload, pos)
        if pos + 8 + n == len(payload) and _code_looks_like(fmt, payload[pos + 8:]):
            return fmt, payload[start:pos], payload[pos + 8:]
    raise ValueError(f"cannot find the code of a CUDA module (fmt {fmt!r})")


def _code_looks_like(fmt: str, code: bytes) -> bool:
    if fmt == "cuda":
        return b"__global__" in code
    return code.startswith(FATBIN_MAGIC) or code.startswith(ELF_MAGIC) or code[:1] == b"/"


def embed_fatbins(blob: bytes, arch: str) -> bytes:
    """The blob with every CUDA module in source form replaced by an nvcc fatbin (a fatbin the
    build-time callback already made, which TVM labels "cubin", is relabelled "fatbin")."""
    row_ptr, children, modules = parse_blob(blob)
    out = []
    for kind, payload in modules:
        if kind == "cuda":
            fmt, table, code = cuda_payload_parts(payload)
            if fmt == "cuda":
                code = nvcc_fatbin(code.decode(), arch)
            if code.startswith(FATBIN_MAGIC):
                payload = _raw(b"fatbin") + table + _raw(code)
        out.append((kind, payload))
    return serialize_blob(row_ptr, children, out)


def _c_array(symbol: str, data: bytes) -> str:
    rows = (",".join(f"0x{b:02x}" for b in data[i:i + 24]) for i in range(0, len(data), 24))
    return (f"const unsigned char {symbol}[{len(data)}] = {{\n  " + ",\n  ".join(rows) + "\n};")


def fatbin_packer(arch: str):
    """export_library's ``fpack_imports`` hook: TVM's C packing of the imports, with the CUDA
    modules compiled to fatbins first.  Returns the path of the C file to link."""
    import tvm_ffi

    def pack(mod, is_system_lib: bool, prefix: str, workspace_dir: str) -> str:
        blob = bytes(tvm_ffi.get_global_func("runtime.ModulePackImportsToTensor")(mod).numpy())
        c_src = str(tvm_ffi.get_global_func("runtime.ModulePackImportsToC")(
            mod, is_system_lib, prefix))
        symbol = prefix + BLOB_SYMBOL
        pattern = re.compile(r"const unsigned char " + re.escape(symbol) + r"\[\d+\] = \{[^}]*\};")
        if len(pattern.findall(c_src)) != 1:
            raise CompileError(f"TVM's packed imports do not define {symbol} once; cannot embed "
                               "the CUDA fatbin (TVM version changed the export format?)")
        c_src = pattern.sub(lambda _m: _c_array(symbol, embed_fatbins(blob, arch)), c_src)
        path = os.path.join(workspace_dir, f"{prefix}devc.c")
        Path(path).write_text(c_src)
        return path

    return pack


# -- reading an exported library ---------------------------------------------------------------
def _elf_symbol_bytes(data: bytes, name: str) -> bytes:
    """The bytes of a defined symbol of a 64-bit little-endian ELF shared object."""
    if data[:4] != ELF_MAGIC or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    for sh in sections:
        if sh[1] not in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            st_name, _info, _other, shndx, value, size = struct.unpack_from("<IBBHQQ", data, off)
            end = data.index(b"\0", strtab[4] + st_name)
            if data[strtab[4] + st_name:end].decode() == name and 0 < shndx < len(sections):
                sec = sections[shndx]
                start = sec[4] + value - sec[3]
                return data[start:start + size]
    raise ValueError(f"symbol {name} not found")


def packed_blob(lib_path: str | Path) -> bytes:
    """The serialized import blob (VM executable, device modules) of an exported ``.so``."""
    return _elf_symbol_bytes(Path(lib_path).read_bytes(), BLOB_SYMBOL)


def device_modules(lib_path: str | Path) -> list[dict]:
    """The modules packed into an exported ``.so``: kind, and for CUDA the format, the code size,
    whether the code is a fatbin / cubin / PTX / CUDA source and the ``sm_XX`` names it holds.
    Reads the file only: works where the library cannot be loaded (no GPU, no CUDA runtime)."""
    _, _, modules = parse_blob(packed_blob(lib_path))
    out = []
    for kind, payload in modules:
        info: dict = {"kind": kind}
        if kind == "cuda" and payload is not None:
            fmt, _table, code = cuda_payload_parts(payload)
            info.update(fmt=fmt, code_bytes=len(code), fatbin=code.startswith(FATBIN_MAGIC),
                        cubin=code.startswith(ELF_MAGIC), ptx=code[:1] == b"/",
                        source=b"__global__" in code,
                        archs=sorted({a.decode() for a in re.findall(rb"sm_\d+a?", code)}))
        out.append(info)
    return out
