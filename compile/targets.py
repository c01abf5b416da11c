"""Target names -> TVM targets, and how each target's artifact is exported."""

from __future__ import annotations

import dataclasses

import tvm

from paged_decode.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    kind: str                # "llvm" | "cuda" | "metal" | "webgpu" | "opencl" | "vulkan"
    target: tvm.target.Target
    library_name: str        # model.so or model.tar
    link_note: str           # how the artifact is loaded / linked on its platform

    @property
    def key_string(self) -> str:
        """The target as it enters the artifact key (kind, mcpu / arch, host)."""
        return str(self.target) + ("|host=" + str(self.target.host) if self.target.host else "")


def host_cpu() -> str:
    return str(tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")())


def _llvm(mcpu: str | None = None) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu or host_cpu()})


def resolve_target(name: str | None) -> TargetSpec:
    """``None`` / "llvm" = this host's CPU; "llvm:<mcpu>" for another x86 CPU."""
    name = (name or "llvm").strip()
    kind, _, arg = name.partition(":")
    if kind == "llvm":
        return TargetSpec("llvm", _llvm(arg or None), "model.so",
                          "load model.so with tvm.runtime.load_module on the same CPU family")
    raise ConfigError(f"target {name!r} is not supported; supported: llvm, llvm:<mcpu>")
