"""Build: the Python package always; the CUDA extension (csrc/) only when torch has CUDA.

    pip install --no-build-isolation -e .          # CPU torch: pure Python, one log line
    GPU_ARCHS="90a" MAX_JOBS=16 pip install --no-build-isolation -e .    # CUDA torch: + _C

GPU_ARCHS: ';'-separated compute capabilities (default 90a = sm_90a for wgmma/setmaxnreg).
MAX_JOBS: parallel compile jobs (torch.utils.cpp_extension honours it).
"""

import glob
import os
import sys

from setuptools import find_packages, setup

PACKAGES = find_packages(include=["primus_turbo", "primus_turbo.*"])
PACKAGES += ["primus_turbo.integrations"] + [
    "primus_turbo.integrations." + p for p in find_packages(where="integrations")
]


def _cublaslt(cuda_home: str):
    """(include dir, library file) of cuBLASLt: the CUDA toolkit's, else the nvidia-cublas wheel that a
    CUDA torch depends on (headers and libcublasLt.so.<major> under nvidia/cu<major>/ or nvidia/cublas/).
    None when neither has cublasLt.h: the cached-plan FP8 GEMM is then left out (torch._scaled_mm serves)."""
    roots = [os.path.join(cuda_home, "include")]
    try:
        import nvidia

        for base in nvidia.__path__:
            roots += sorted(glob.glob(os.path.join(base, "cu*", "include")))
            roots.append(os.path.join(base, "cublas", "include"))
    except ImportError:
        pass
    for inc in roots:
        if not os.path.exists(os.path.join(inc, "cublasLt.h")):
            continue
        lib_dirs = [os.path.join(os.path.dirname(inc), d) for d in ("lib", "lib64")]
        libs = [f for d in lib_dirs for f in sorted(glob.glob(os.path.join(d, "libcublasLt.so*")))]
        if libs:
            return inc, min(libs, key=len)  # libcublasLt.so when present, else libcublasLt.so.<major>
    return None


def _cuda_extension():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("primus_turbo: torch is not importable at build time; skipping the CUDA extension")
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None or os.environ.get("PRIMUS_TURBO_SKIP_CUDA") == "1":
        print(
            f"primus_turbo: torch {torch.__version__} has no CUDA (or CUDA_HOME is unset); skipping the "
            "csrc extension: TURBO backends are unavailable, every op still works on its other backends"
        )
        return [], {}
    archs = [a.strip() for a in os.environ.get("GPU_ARCHS", "90a").replace(",", ";").split(";") if a.strip()]
    gencode = []
    for arch in archs:
        arch = arch.replace("sm_", "")
        gencode += [f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    sources = sorted(
        glob.glob("csrc/kernels/**/*.cu", recursive=True) + glob.glob("csrc/pytorch/**/*.cpp", recursive=True)
    )
    include_dirs, link_args, defines = [os.path.abspath("csrc/include")], [], []
    lt = _cublaslt(CUDA_HOME)
    if lt is None:
        print("primus_turbo: cublasLt.h not found; building without the cached-plan FP8 GEMM op")
        sources = [s for s in sources if "gemm_fp8_cublaslt" not in s]
        defines = ["-DPRIMUS_TURBO_NO_CUBLASLT"]
    else:
        include_dirs.append(lt[0])
        link_args = [lt[1], f"-Wl,-rpath,{os.path.dirname(lt[1])}"]
    if sys.platform.startswith("linux"):
        # The shared libstdc++ the process already has, never a static copy: a compiler whose own lib
        # dir holds only libstdc++.a (seen: the GPU machine's /opt/gcc wrapper) otherwise links one into
        # _C, and its uninitialised locale facets crash every error message that formats a number.
        # Named before the driver's implicit -lstdc++, so the archive contributes nothing.
        link_args.append("-l:libstdc++.so.6")
    ext = CUDAExtension(
        name="primus_turbo.pytorch._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", *defines],
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", *gencode, *defines],
        },
        extra_link_args=link_args,
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _cuda_extension()

setup(
    packages=PACKAGES,
    package_dir={"primus_turbo.integrations": "integrations"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
