"""Builds the torch_ext._C extension (the entropy_attn operators) with torch.utils.cpp_extension."""

import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources() -> list[str]:
    """C++ sources of the extension, relative to the project root, in a stable order."""
    files = glob.glob("csrc/*.cpp", root_dir=ROOT) + glob.glob("csrc/cpu/*.cpp", root_dir=ROOT)
    return sorted(files)


setup(
    name="torch_ext",
    version="0.1.0",
    description="Entropy-invariant fused attention with per-row statistics for PyTorch",
    packages=find_packages(include=["torch_ext", "torch_ext.*"]),
    ext_modules=[
        CppExtension(
            "torch_ext._C",
            sources(),
            extra_compile_args={"cxx": ["-O3", "-fopenmp-simd"]},
            py_limited_api=True,
        )
    ],
    cmdclass={"ext_modules": BuildExtension, "build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
    python_requires=">=3.11",
    install_requires=["torch>=2.13"],
)
