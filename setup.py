"""Builds the torch_ext._C extension (the entropy_attn operators) with torch.utils.cpp_extension.

CUDA: when torch is a CUDA build and a CUDA toolkit (nvcc) is found, the extension also builds
csrc/cuda/**/*.cu (device code, nvcc) and csrc/cuda/*.cpp (host code), for the architectures of
TORCH_CUDA_ARCH_LIST (default "8.0;9.0+PTX"). The tensor-core family (csrc/cuda/sm80) is written with
CuTe: its headers come from the pinned nvidia-cutlass package (csrc/cuda/cutlass_version.txt),
found where it is installed. A family that csrc/cuda/kernels.toml restricts to one `gencode` (sm90:
sm_90a) has its translation units compiled for that target alone, and one that declares where its
device code changes with the architecture (`ptx_changes_at`) compiles one PTX for the architectures
between two changes (BuildExtensionPerUnitTarget). ENTROPY_ATTN_CPU_ONLY=1 forces the CPU-only build.
The host C++ sources of each directory compile as one translation unit (unity_sources).
ENTROPY_ATTN_WERROR=1 (set by CI) turns compiler warnings in our sources into errors.
ENTROPY_ATTN_UNTESTED_KERNELS=1 also compiles the kernels of capabilities that are off by default
until tested on a GPU (csrc/cuda/untested_kernels.h; none at present), which "auto" never selects;
scripts/device_bundle.sh builds so for GPU sessions, whose tests force them.

Packaging (pyproject.toml holds the static metadata): the version is torch_ext/_version.py's; the
package requires the torch major.minor it is compiled against, and records the exact torch version
in torch_ext/_build_info.py, which `import torch_ext` checks. Build with the torch you will run
(`pip install --no-build-isolation .`).
"""

import glob
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import setuptools
from setuptools import find_packages, setup

# pyproject.toml writes its license as an SPDX expression (PEP 639), which setuptools reads from
# version 77 on; an older one stops with a schema error about `project.license` that names neither.
if int(setuptools.__version__.split(".")[0]) < 77:
    sys.exit(f"setup.py: building torch_ext needs setuptools>=77 (found {setuptools.__version__}): "
             "pip install -U 'setuptools>=77'")

try:
    import torch
except ImportError:  # pip's build isolation, or no torch at all
    sys.exit("setup.py: torch_ext compiles against the installed torch, and none is importable here. Install "
             "torch first (pip install torch==2.14.1), then build without build isolation: "
             "pip install --no-build-isolation .")

ROOT = os.path.dirname(os.path.abspath(__file__))


def package_version() -> str:
    """torch_ext/_version.py's __version__ (the one place it is written)."""
    with open(os.path.join(ROOT, "torch_ext", "_version.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.MULTILINE).group(1)


def torch_requirement() -> str:
    """The torch this build is compiled against, as a requirement: the same major.minor (the C++
    ABI of libtorch changes between minor releases)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"


def sources_sha256() -> str:
    """The hash of the files this build compiles or reads (scripts/sources_hash.sh, the one
    definition), or "unknown" where it cannot run."""
    try:
        out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "sources_hash.sh")], capture_output=True,
                             text=True, timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out or "unknown"


def write_build_info() -> None:
    """torch_ext/_build_info.py: the torch this build compiles against, which `import torch_ext`
    compares with the running torch, and the hash of its sources, which benchmark results record
    (the kernels measured: equal to scripts/sources_hash.sh at the commit they come from)."""
    with open(os.path.join(ROOT, "torch_ext", "_build_info.py"), "w", encoding="utf-8") as f:
        f.write('"""Written by setup.py at build time: the torch this build of torch_ext is compiled against,\n'
                'and the hash of the sources it was built from (scripts/sources_hash.sh)."""\n\n'
                f"TORCH_VERSION = {torch.__version__.split('+')[0]!r}\n"
                f"SOURCES_SHA256 = {sources_sha256()!r}\n"
                "# Whether the kernels compiled on request are in (ENTROPY_ATTN_UNTESTED_KERNELS=1).\n"
                f"UNTESTED_KERNELS = {UNTESTED_KERNELS!r}\n")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import kernel_list  # noqa: E402
from cuda_home import cuda_home  # noqa: E402
WERROR = os.environ.get("ENTROPY_ATTN_WERROR") == "1"
UNTESTED_KERNELS = os.environ.get("ENTROPY_ATTN_UNTESTED_KERNELS") == "1"


CUDA_HOME = cuda_home() if os.environ.get("ENTROPY_ATTN_CPU_ONLY") != "1" and torch.version.cuda else None
WITH_CUDA = CUDA_HOME is not None
if WITH_CUDA:
    # Read by torch.utils.cpp_extension when it is imported (below). Without a GPU and without
    # TORCH_CUDA_ARCH_LIST, CUDAExtension would compile for every architecture torch knows.
    os.environ["CUDA_HOME"] = CUDA_HOME
    # (+PTX: the PTX is embedded as well, so that a GPU newer than sm_90, a Blackwell, compiles the
    # kernels when it loads them, instead of finding no code for itself.)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, include_paths  # noqa: E402


def sources() -> list[str]:
    """Sources of the extension, relative to the project root, in a stable order: without
    ENTROPY_ATTN_UNTESTED_KERNELS=1, less the kernel units that hold only instantiations compiled on
    request (they would compile empty)."""
    patterns = ["csrc/*.cpp", "csrc/cpu/*.cpp"] + (["csrc/cuda/**/*.cu", "csrc/cuda/*.cpp"] if WITH_CUDA else [])
    skipped = set() if UNTESTED_KERNELS else {str(p.relative_to(ROOT)) for p in kernel_list.on_request_units()}
    return sorted(f for pattern in patterns for f in glob.glob(pattern, root_dir=ROOT, recursive=True)
                  if f not in skipped)


# Host sources that compile on their own, not in their directory's unit (unity_sources):
# python_module.cpp includes Python.h first, as Python asks; autocast.cpp lifts
# TORCH_ASSERT_ONLY_METHOD_OPERATORS for ATen's autocast header, which would lift it for the files
# after it too. (CMakeLists.txt builds the same units.)
STANDALONE_SOURCES = {"csrc/python_module.cpp", "csrc/autocast.cpp"}


def unity_sources(files: list[str]) -> list[str]:
    """`files` with the host C++ sources (.cpp) of each directory compiled as one translation unit:
    build/unity/<directory>.cpp, which includes them (their paths relative to csrc/, an include
    directory). Torch's headers are then parsed, and the inline functions of theirs that we call
    compiled, once per directory rather than once per file, which were most of each file's time:
    the host code's compile went from 210 to 61 CPU-seconds (-O3, torch 2.14). What it costs: a
    name with internal linkage must be unique within its directory, an edit recompiles the whole
    directory's unit (~27 s for csrc/), and since no build compiles a file alone, an include that a
    file lacks can hide behind an earlier file of its unit. The CUDA sources and STANDALONE_SOURCES
    stay as they are. build/unity/ holds this build's units alone (another's are removed, so that
    tests/test_build.py reads what was built); a unit is rewritten only when its text changes,
    so that ninja and ccache find it unchanged, and by a rename, never half-written."""
    groups: dict[str, list[str]] = {}
    kept = []
    for f in files:
        relative = os.path.relpath(os.path.join(ROOT, f), ROOT)  # (the build may pass absolute paths)
        if relative.endswith(".cpp") and relative not in STANDALONE_SOURCES:
            groups.setdefault(os.path.dirname(relative), []).append(relative)
        else:
            kept.append(f)
    unity_dir = os.path.join(ROOT, "build", "unity")
    os.makedirs(unity_dir, exist_ok=True)
    units = []
    for directory, members in sorted(groups.items()):
        unit = os.path.join("build", "unity", directory.replace("/", "_") + ".cpp")
        text = (f"// Generated by setup.py (unity_sources): the host sources of {directory}/ as one "
                "translation unit.\n" + "".join(f'#include "{os.path.relpath(m, "csrc")}"\n' for m in members))
        path = os.path.join(ROOT, unit)
        try:
            with open(path, encoding="utf-8") as f:
                unchanged = f.read() == text
        except OSError:
            unchanged = False
        if not unchanged:
            with open(f"{path}.{os.getpid()}", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(f"{path}.{os.getpid()}", path)
        units.append(unit)
    for stale in set(glob.glob("*.cpp", root_dir=unity_dir)) - {os.path.basename(u) for u in units}:
        os.remove(os.path.join(unity_dir, stale))
    return units + kept


def cutlass_include() -> str:
    """The CUTLASS/CuTe headers of the installed nvidia-cutlass package, at the pinned version."""
    with open(os.path.join(ROOT, "csrc", "cuda", "cutlass_version.txt"), encoding="utf-8") as f:
        pinned = f.read().strip()
    spec = importlib.util.find_spec("cutlass_library")
    try:
        installed = importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if spec is None or installed != pinned:
        sys.exit(f"setup.py: the CUDA build needs the CUTLASS headers of nvidia-cutlass=={pinned} (found "
                 f"{installed or 'none'}): pip install --no-deps nvidia-cutlass=={pinned}, or set "
                 "ENTROPY_ATTN_CPU_ONLY=1")
    return os.path.join(spec.submodule_search_locations[0], "source", "include")


# -fopenmp: at::parallel_for is a header template whose `#pragma omp parallel` is compiled into our
# library: without the flag every kernel silently runs on one thread. The libgomp.so.1 it links
# against is, at run time, the one torch has already loaded (same soname), so torch.set_num_threads
# governs our kernels too. Torch's headers warn under -Wextra: as system headers (-isystem outranks
# the -I that cpp_extension adds for the same directories) they stay quiet, and the warnings left
# are ours. -g1: line tables only (as -lineinfo for the kernels), enough for a backtrace to name
# file and line; the full debug information that Python's -g asks for made the C++ compile 37%
# slower (autograd.cpp: 28 s -> 18 s) and its objects up to 30x larger.
# AT_PER_OPERATOR_HEADERS and TORCH_ASSERT_ONLY_METHOD_OPERATORS, as PyTorch builds its own
# sources: each file includes the ATen operators it calls (ATen/ops/*.h), not all of them
# (ATen/ATen.h, whose parsing took a quarter of a typical file's compile time), and including all
# of them is an error. (CMakeLists.txt and scripts/device_bundle.sh's check define them as well.)
ATEN_DEFINES = ["-DAT_PER_OPERATOR_HEADERS", "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS"]
# -fno-trapping-math: the CPU kernels' row loops (csrc/cpu/row_kernels.cpp) select 0 for keys
# whose exponential underflows or that are masked, which GCC turns into a branch around the
# exponential; under the default -ftrapping-math it may not evaluate that arithmetic for every lane
# again, so without AVX-512's masked instructions the loops stayed scalar: the AVX2 and baseline
# clones of the forward's exp loop ran 8 and 4 times slower than vector code (a float32 forward
# took 2.4x SDPA's time on an AVX2 CPU). Results are unchanged (nothing here reads floating-point
# exception flags). (CMakeLists.txt sets it too; tests/test_build.py checks the clones' vectors.)
VECTORIZE_FLAGS = ["-fno-trapping-math"]
UNTESTED_DEFINES = [f"-D{kernel_list.UNTESTED_MACRO}"] if UNTESTED_KERNELS else []
CXX_FLAGS = (["-O3", "-g1", "-fopenmp", *VECTORIZE_FLAGS, "-Wall", "-Wextra", *ATEN_DEFINES, *UNTESTED_DEFINES]
             + [flag for path in include_paths() for flag in ("-isystem", path)]
             + (["-Werror"] if WERROR else []))
# The .cu files include no torch header: every host-compiler warning is ours. torch adds -std=c++20,
# -D__CUDA_NO_HALF_OPERATORS__ & co. and the -gencode flags of TORCH_CUDA_ARCH_LIST.
# CuTe's headers as system headers (their warnings are not ours); -DNDEBUG drops CuTe's device
# asserts from the kernels.
NVCC_FLAGS = (["-O3", "-lineinfo", "-DNDEBUG", "-Xcompiler=-Wall,-Wextra", *UNTESTED_DEFINES]
              + (["-isystem", cutlass_include()] if WITH_CUDA else [])
              + (["-Werror=all-warnings", "-Xcompiler=-Werror", "-Xptxas=-Werror"] if WERROR else []))


def shared_libstdcxx_flags() -> list[str]:
    """The libstdc++.so.6 that torch (imported above) runs on, as a link input ahead of the
    driver's own -lstdc++: the C++ runtime is then linked dynamically whatever that -lstdc++ would
    find, and -lstdc++ adds nothing. Where g++ finds libstdc++.so first this changes nothing.

    A toolchain with only a static runtime in reach (on one GPU machine, a relocated g++ behind a
    wrapper whose -B directory holds libstdc++.a and a dangling libstdc++.so symlink) otherwise
    links a private copy of libstdc++ into our library. With Python's -Wl,-Bsymbolic-functions that
    copy's functions run on the data of the process's libstdc++.so.6 (another GCC's), and the
    first number written into a std::ostringstream (c10::str: every TORCH_CHECK message with a
    size in it) segfaulted instead of raising, on the CPU and CUDA alike. tests/test_build.py
    checks the result."""
    if not sys.platform.startswith("linux"):
        return []
    with open("/proc/self/maps", encoding="utf-8") as maps:
        loaded = sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})
    return loaded[:1] or ["-l:libstdc++.so.6"]


LINK_FLAGS = ["-fopenmp"] + shared_libstdcxx_flags()


def shared_ptx_flags() -> dict[Path, tuple[str, ...]]:
    """The translation units of the families that declare where their device code changes with the
    architecture (kernels.toml: ptx_changes_at) -> their -gencode flags: TORCH_CUDA_ARCH_LIST's, with
    the architectures that no change separates compiled from one PTX (kernel_list.share_ptx; for
    "8.0;9.0", sm_90's machine code assembled from the sm_80 PTX: the same instructions, half the
    front-end time). Units that would gain nothing stay in the main pass."""
    try:
        from torch.utils.cpp_extension import _get_cuda_arch_flags  # torch's reading of the list
    except ImportError:  # (private: a torch without it builds every architecture from its own PTX)
        return {}
    arch_flags = _get_cuda_arch_flags()
    shared = {path: tuple(kernel_list.share_ptx(arch_flags, changes))
              for path, changes in kernel_list.shared_ptx_units().items()}
    return {path: flags for path, flags in shared.items() if list(flags) != arch_flags}


class BuildExtensionPerUnitTarget(BuildExtension.with_options(use_ninja=True)):
    """BuildExtension (ninja) that compiles the translation units of the families kernels.toml
    restricts to one target (`gencode`) apart, with that -gencode added to the nvcc flags: a user
    -gencode makes torch leave out TORCH_CUDA_ARCH_LIST's, so those units are built for their
    target alone (sm_90a for wgmma and setmaxnreg, which no other target has); likewise the units
    whose architectures share one PTX (shared_ptx_flags), with their own -gencode flags. Their
    objects join the link of the extension; the other sources build as before.

    Every build compiles in one directory of the tree, build/temp.<platform>-<python>: an
    editable install (pip install -e, which setuptools points at a fresh temporary directory),
    `setup.py build_ext --inplace` and a wheel build (python -m build) share their objects, so
    that ninja recompiles only what changed between them (CI builds the wheel after the editable
    install without compiling anything again). The host C++ sources compile as one unit per
    directory (unity_sources)."""

    def finalize_options(self):
        super().finalize_options()
        tag = f"{self.plat_name}-{sys.implementation.cache_tag}{sys.abiflags}"  # setuptools' default name
        self.build_temp = os.path.join(ROOT, "build", f"temp.{tag}")

    def build_extension(self, ext):
        # (Here, not in the sources given to setup(): `setup.py --version`, egg_info and sdist
        # write nothing under build/.)
        ext.sources = unity_sources(ext.sources)
        by_flags: dict[tuple[str, ...], list[str]] = {}
        if WITH_CUDA:
            units = {str(path.relative_to(ROOT)): (flag,) for path, flag in kernel_list.gencode_units().items()}
            units.update((str(path.relative_to(ROOT)), flags) for path, flags in shared_ptx_flags().items())
            for source in ext.sources:
                if (flags := units.get(os.path.relpath(os.path.join(ROOT, source), ROOT))) is not None:
                    by_flags.setdefault(flags, []).append(source)
        for flags, group in by_flags.items():
            args = dict(ext.extra_compile_args, nvcc=ext.extra_compile_args["nvcc"] + list(flags))
            ext.extra_objects = list(ext.extra_objects or []) + self.compiler.compile(
                group, output_dir=self.build_temp, macros=ext.define_macros, include_dirs=ext.include_dirs,
                debug=self.debug, extra_postargs=args, depends=ext.depends)
            ext.sources = [source for source in ext.sources if source not in group]
        super().build_extension(ext)


extension = CUDAExtension if WITH_CUDA else CppExtension
write_build_info()
setup(
    version=package_version(),
    packages=find_packages(include=["torch_ext", "torch_ext.*"]),
    ext_modules=[
        extension(
            "torch_ext._C",
            sources(),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
            extra_link_args=LINK_FLAGS,
            py_limited_api=True,
        )
    ],
    cmdclass={"ext_modules": BuildExtension, "build_ext": BuildExtensionPerUnitTarget},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
    install_requires=[torch_requirement()],
)
