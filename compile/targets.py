"""Target names -> TVM targets, and how each target's artifact is exported and loaded.

| name            | device code in the artifact                     | host          | library   |
|-----------------|-------------------------------------------------|---------------|-----------|
| llvm[:mcpu]     | x86-64 machine code                             | (itself)      | model.so  |
| cuda[:sm_XX]    | fatbin from nvcc: sm_XX SASS + compute_XX PTX   | x86-64 llvm   | model.so  |
| opencl          | OpenCL C source (the driver compiles it at load) | x86-64 llvm   | model.so  |
| metal           | Metal shading language source                    | arm64 macOS   | model.tar |
| webgpu          | WGSL source                                      | wasm32        | model.tar |
| vulkan          | SPIR-V: needs a TVM built with USE_VULKAN        | x86-64 llvm   | model.so  |

Only ``.tar`` export works for metal and webgpu on Linux (no Mach-O / wasm linker here): the tar
holds the host object and the device module, linked on the target platform (``link_note``).
"""

from __future__ import annotations

import dataclasses
import re
import shutil

import tvm

from paged_decode.runtime.errors import ConfigError

DEFAULT_CUDA_ARCH = "sm_90"
GPU_KINDS = ("cuda", "metal", "webgpu", "opencl", "vulkan")
KINDS = ("llvm",) + GPU_KINDS

_GENERIC_X86 = {"kind": "llvm", "mtriple": "x86_64-linux-gnu"}  # GPU hosts: any x86-64 CPU
_HOSTS = {
    "cuda": _GENERIC_X86,
    "opencl": _GENERIC_X86,
    "vulkan": _GENERIC_X86,
    "metal": {"kind": "llvm", "mtriple": "arm64-apple-macos"},
    "webgpu": {"kind": "llvm", "mtriple": "wasm32-unknown-unknown-wasm"},
}
_LIBRARY = {"metal": "model.tar", "webgpu": "model.tar"}

_LINK_NOTES = {
    "cuda": ("model.so for x86-64 Linux: tvm.runtime.load_module('model.so') with an NVIDIA "
             "driver for {arch} or newer, device tvm.cuda(0); the kernels are embedded as an nvcc "
             "fatbin ({arch} SASS + PTX), so the loading machine needs neither nvcc nor NVRTC"),
    "opencl": ("model.so for x86-64 Linux: load with a TVM runtime built with USE_OPENCL (the "
               "PyPI wheel has no OpenCL runtime) and an OpenCL 1.2 ICD, device tvm.opencl(0); "
               "the driver compiles the embedded OpenCL C at load"),
    "metal": ("model.tar (arm64 macOS host object + Metal source): on the Mac, "
              "tvm.runtime.load_module('model.tar') links it with the system compiler (or "
              "export once with tvm.support.cc.create_shared), device tvm.metal(0); the Metal "
              "driver compiles the shaders at load"),
    "webgpu": ("model.tar (wasm32 host object + WGSL): link with emscripten through "
               "tvm.contrib.tvmjs.create_tvmjs_wasm into model.wasm and load it with tvmjs in a "
               "browser with WebGPU (shader-f16 for float16 caches)"),
    "vulkan": ("needs a TVM built with USE_VULKAN=ON (SPIR-V codegen); load model.so with "
               "device tvm.vulkan(0)"),
}


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    kind: str                # "llvm" | "cuda" | "metal" | "webgpu" | "opencl" | "vulkan"
    target: tvm.target.Target
    library_name: str        # model.so or model.tar
    link_note: str           # how the artifact is loaded / linked on its platform
    name: str = ""           # the name it was resolved from ("cuda:sm_80"), for messages

    @property
    def default_block_size(self) -> int:
        """Tokens per KV block when the user names none.  On the CPU a decode thread reads a
        block of every kv head as one run from K and one from V, and the hardware prefetcher
        starts over at every run of a scattered block table; longer blocks mean fewer restarts
        (64 against 32 and 128: docs/design.md).  GPUs keep 16, the common paged-attention block
        there."""
        return 64 if self.kind == "llvm" else 16

    @property
    def key_string(self) -> str:
        """The target as it enters the artifact key (kind, mcpu / arch, host)."""
        return str(self.target) + ("|host=" + str(self.target.host) if self.target.host else "")

    @property
    def arch(self) -> str | None:
        """The CUDA architecture (``sm_90``), None for other kinds."""
        return str(self.target.attrs["arch"]) if self.kind == "cuda" else None

    def missing_toolchain(self) -> str | None:
        """Why this machine cannot build the target (None when it can)."""
        if tvm.get_global_func(f"target.build.{self.kind}", allow_missing=True) is None:
            return (f"this TVM {tvm.__version__} has no {self.kind} code generator "
                    f"(target.build.{self.kind} is missing: the PyPI wheel is built without "
                    f"{'USE_VULKAN / SPIR-V' if self.kind == 'vulkan' else self.kind}); build "
                    f"TVM from source with USE_{self.kind.upper()}=ON to compile for {self.kind}")
        if self.kind == "cuda" and shutil.which("nvcc") is None:
            return ("nvcc is not on PATH: the CUDA artifact embeds a fatbin compiled by nvcc at "
                    "build time; install the CUDA toolkit (any release that knows "
                    f"{self.arch}) or put its bin/ on PATH")
        return None


def host_cpu() -> str:
    return str(tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")())


def _llvm(mcpu: str | None = None) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu or host_cpu()})


def _cuda(arch: str) -> tvm.target.Target:
    if not re.fullmatch(r"sm_\d{2,3}[a-z]?", arch):
        raise ConfigError(f"target cuda:{arch}: the CUDA architecture must look like sm_80, "
                          "sm_90 or sm_90a")
    return tvm.target.Target({"kind": "cuda", "arch": arch}, host=_HOSTS["cuda"])


def resolve_target(name: str | None) -> TargetSpec:
    """``None`` / "llvm" = this host's CPU; "llvm:<mcpu>" for another x86 CPU; "cuda" (sm_90) or
    "cuda:sm_XX"; "metal", "webgpu", "opencl", "vulkan"."""
    name = (name or "llvm").strip()
    kind, _, arg = name.partition(":")
    if kind == "llvm":
        return TargetSpec("llvm", _llvm(arg or None), "model.so",
                          "load model.so with tvm.runtime.load_module on the same CPU family",
                          name)
    if kind == "cuda":
        arch = arg or DEFAULT_CUDA_ARCH
        return TargetSpec("cuda", _cuda(arch), "model.so",
                          _LINK_NOTES["cuda"].format(arch=arch), f"cuda:{arch}")
    if kind in GPU_KINDS:
        if arg:
            raise ConfigError(f"target {name!r}: {kind} takes no option (only llvm:<mcpu> and "
                              "cuda:<sm_XX> do)")
        return TargetSpec(kind, tvm.target.Target({"kind": kind}, host=_HOSTS[kind]),
                          _LIBRARY.get(kind, "model.so"), _LINK_NOTES[kind], kind)
    raise ConfigError(f"target {name!r} is not supported; supported: llvm, llvm:<mcpu>, cuda, "
                      "cuda:<sm_XX>, metal, webgpu, opencl, vulkan")
