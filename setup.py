"""Thin driver: configures and builds the extension with CMake + ninja against the
torch installed in this Python (use `pip install --no-build-isolation .`).

Environment:
  MOE_FP8_CUDA_ARCHS   CUDA architectures to build, default "90a;100a"
  PYTORCH_ROCM_ARCH    AMD architectures for a ROCm torch, default "gfx942;gfx950"
  MOE_FP8_FORCE_CPU=1  build the CPU kernels only, even with a CUDA torch and nvcc
  MOE_FP8_CXX          host C++ compiler (default: the g++ on PATH, which is also the
                       one nvcc uses; a compiler whose libstdc++ is newer than the one
                       loaded at run time makes a module that crashes on throw)
  MAX_JOBS             parallel compile jobs
  MOE_FP8_NO_SOURCE_COPY=1  leave moe_fp8_ext/ in the source tree alone (a build for
                       another machine's torch: scripts/prebuild.sh)
"""

import os
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


MODULE = "_C.abi3.so"  # CMakeLists.txt names it so


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        # py_limited_api: the module is `_C.abi3.so` (CPython's stable ABI, csrc/bindings.cpp),
        # and the wheel is tagged cp310-abi3 (the options of setup() below).
        super().__init__(name, sources=[], py_limited_api=True)
        self.sourcedir = os.path.dirname(os.path.abspath(__file__))


def _backend() -> str:
    import torch

    if os.environ.get("MOE_FP8_FORCE_CPU") == "1":
        return "cpu"
    if torch.version.hip:
        return "hip"
    if torch.version.cuda:
        from torch.utils.cpp_extension import CUDA_HOME

        if shutil.which("nvcc") or (CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))):
            return "cuda"
        print("moe_fp8_ext: CUDA torch but no nvcc found; building the CPU kernels only", file=sys.stderr)
    return "cpu"


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        backend = _backend()
        # A stable build folder per backend (incremental rebuilds, logs); the module is linked
        # inside it and copied out, so a CPU and a CUDA build (scripts/prebuild.sh) never
        # share a file that ninja, finding it newer than its inputs, would not relink.
        build_dir = os.path.join(ext.sourcedir, "build", f"cmake-{backend}")
        module_dir = os.path.join(build_dir, "module")
        os.makedirs(build_dir, exist_ok=True)
        args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DMOE_FP8_OUTPUT_DIR={module_dir}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DMOE_FP8_WITH_CUDA={'ON' if backend == 'cuda' else 'OFF'}",
            f"-DMOE_FP8_WITH_HIP={'ON' if backend == 'hip' else 'OFF'}",
            f"-DMOE_FP8_CUDA_ARCHS={os.environ.get('MOE_FP8_CUDA_ARCHS', '90a;100a')}",
        ]
        # One host compiler for the C++ files, nvcc's host side and the link (the libstdc++
        # loaded at run time); $CXX / $CUDAHOSTCXX too, as CMake's CUDA detection asks nvcc
        # for that compiler's link folders.
        env = dict(os.environ)
        cxx = os.environ.get("MOE_FP8_CXX") or shutil.which("g++")
        if cxx:
            args.append(f"-DCMAKE_CXX_COMPILER={cxx}")
            env["CXX"] = env["CUDAHOSTCXX"] = cxx
            if backend == "cuda":
                args.append(f"-DCMAKE_CUDA_HOST_COMPILER={cxx}")
        if backend == "hip":
            # The kernels are written once in CUDA; ROCm builds compile a hipified copy.
            sys.path.insert(0, os.path.join(ext.sourcedir, "scripts"))
            from hipify_tree import hipify_tree

            hip_root = os.path.join(build_dir, "hipified")
            hipify_tree(os.path.join(ext.sourcedir, "csrc"), hip_root)
            args += [
                f"-DMOE_FP8_SOURCE_DIR={hip_root}",
                f"-DMOE_FP8_HIP_ARCHS={os.environ.get('PYTORCH_ROCM_ARCH', 'gfx942;gfx950')}",
            ]
        if backend == "cuda":
            from torch.utils.cpp_extension import CUDA_HOME

            nvcc = shutil.which("nvcc") or os.path.join(CUDA_HOME, "bin", "nvcc")
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", ext.sourcedir, *args], cwd=build_dir, env=env)
        subprocess.check_call(["cmake", "--build", ".", "-j", jobs], cwd=build_dir, env=env)
        dest = self.get_ext_fullpath(ext.name)
        if os.path.basename(dest) != MODULE:
            raise RuntimeError(f"moe_fp8_ext: this Python wants the module as {os.path.basename(dest)}; the build "
                               f"makes {MODULE} (CPython's stable ABI, 3.10 or newer)")
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        _replace(os.path.join(module_dir, MODULE), dest)
        _remove_other_modules(os.path.dirname(os.path.abspath(dest)), MODULE)
        if os.environ.get("MOE_FP8_NO_SOURCE_COPY") != "1":
            _copy_to_source_tree(dest, ext)


def _replace(src: str, dest: str) -> None:
    """Copy by a rename: a process that has the old module loaded keeps a valid mapping."""
    if os.path.abspath(src) == os.path.abspath(dest):
        return
    tmp = dest + ".tmp"
    shutil.copy2(src, tmp)
    os.replace(tmp, dest)


def _remove_other_modules(folder: str, keep: str) -> None:
    """Remove `_C.*.so` files other than `keep` from `folder`: one left by an older build
    (`_C.cpython-311-...so`) would be imported before `_C.abi3.so`, since Python tries
    the interpreter's own suffix first, and a wheel would pack both."""
    for name in os.listdir(folder):
        if name.startswith("_C.") and name.endswith(".so") and name != keep:
            try:
                os.remove(os.path.join(folder, name))
            except OSError as e:
                print(f"moe_fp8_ext: could not remove the old module {name}: {e}", file=sys.stderr)


def _copy_to_source_tree(built: str, ext: CMakeExtension) -> None:
    """Also put the built module next to the Python sources, as an in-place build does.

    Run from the repository root, `python -m moe_fp8_ext` and `python -m pytest tests`
    import the package from the source tree (the current directory comes first on
    sys.path), not the installed copy; with the module there, the source tree is a
    complete package and both work after a plain `pip install --no-build-isolation .`.
    """
    dest_dir = os.path.join(ext.sourcedir, *ext.name.split(".")[:-1])
    dest = os.path.join(dest_dir, os.path.basename(built))
    if not os.path.isdir(dest_dir):
        return
    _remove_other_modules(dest_dir, os.path.basename(built))
    try:
        _replace(built, dest)  # (nothing to do for an in-place or editable build)
    except OSError as e:  # a read-only checkout: the installed package still works
        print(f"moe_fp8_ext: could not copy the built module into {dest_dir}: {e}", file=sys.stderr)


setup(
    packages=find_packages(include=["moe_fp8_ext", "moe_fp8_ext.*"]),
    ext_modules=[CMakeExtension("moe_fp8_ext._C")],
    cmdclass={"build_ext": CMakeBuild},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
