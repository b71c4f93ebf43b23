"""Build: the Python package always; the CUDA extension (csrc/) only when torch has CUDA.

    pip install --no-build-isolation -e .          # CPU torch: pure Python, one log line
    GPU_ARCHS="90a" MAX_JOBS=16 pip install --no-build-isolation -e .    # CUDA torch: + _C

GPU_ARCHS: ';'-separated compute capabilities (default 90a = sm_90a for wgmma/setmaxnreg).
MAX_JOBS: parallel compile jobs (torch.utils.cpp_extension honours it).
"""

import glob
import os

from setuptools import find_packages, setup

PACKAGES = find_packages(include=["primus_turbo", "primus_turbo.*"])
PACKAGES += ["primus_turbo.integrations"] + [
    "primus_turbo.integrations." + p for p in find_packages(where="integrations")
]


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
    ext = CUDAExtension(
        name="primus_turbo.pytorch._C",
        sources=sources,
        include_dirs=[os.path.abspath("csrc/include")],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17"],
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", *gencode],
        },
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _cuda_extension()

setup(
    packages=PACKAGES,
    package_dir={"primus_turbo.integrations": "integrations"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
