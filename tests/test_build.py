"""How the extension was built, where a wrong flag fails silently rather than loudly."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_ext


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks a GNU OpenMP (libgomp) build")
def test_cpu_kernels_compiled_with_openmp() -> None:
    """at::parallel_for is a header template whose `#pragma omp parallel` is compiled into our
    library: built without -fopenmp, every CPU kernel runs on one thread and every result is still
    right. With it, the library calls libgomp's GOMP_parallel."""
    library = Path(torch_ext._C.__file__).read_bytes()
    assert b"GOMP_parallel" in library, "torch_ext._C was built without OpenMP: CPU kernels run on one thread"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks an ELF shared library")
def test_cpp_runtime_linked_dynamically() -> None:
    """The extension uses the process's libstdc++.so.6, not a private static copy (which a g++
    that finds libstdc++.a first links in: setup.py's shared_libstdcxx_flags). With Python's
    -Wl,-Bsymbolic-functions such a copy's functions run on another libstdc++'s data: formatting a
    number into an error message (every TORCH_CHECK with a size) segfaulted instead of raising."""
    library = Path(torch_ext._C.__file__)
    assert b"libstdc++.so.6" in library.read_bytes(), "torch_ext._C does not link libstdc++.so.6"
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the defined dynamic symbols")
    defined = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    # std::basic_ostream<char>::_M_insert<long> & co., the function that crashed: libstdc++'s, never ours.
    assert "_ZNSo9_M_insert" not in defined.stdout, "torch_ext._C carries its own static copy of libstdc++"
    # The error path it broke, with numbers in the message, raises.
    with pytest.raises(ValueError, match="head_dim, got 4 and 6"):
        torch.ops.entropy_attn.attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 6), torch.randn(1, 2, 5, 6))


def test_every_build_includes_only_the_aten_operators_it_calls() -> None:
    """The library's C++ includes per-operator ATen headers, never ATen/ATen.h, and every build of
    it (setup.py, CMake, the device torch check's syntax pass) defines the two macros that make
    ATen/ATen.h an error there: a build missing them would compile an ATen/ATen.h that crept back.
    One file lifts the macro: csrc/autocast.cpp, for ATen's autocast header (which includes all of
    ATen and alone declares the autocast dtype and cast)."""
    root = Path(__file__).resolve().parent.parent
    sources = [p for p in (root / "csrc").rglob("*") if p.suffix in (".cpp", ".h")]
    assert sources and not [p for p in sources if "<ATen/ATen.h>" in p.read_text()]
    lifted = sorted(p.relative_to(root).as_posix() for p in sources
                    if "#undef TORCH_ASSERT_ONLY_METHOD_OPERATORS" in p.read_text())
    assert lifted == ["csrc/autocast.cpp"], lifted
    macros = ("AT_PER_OPERATOR_HEADERS", "TORCH_ASSERT_ONLY_METHOD_OPERATORS")
    for build in ("setup.py", "scripts/device_bundle.sh"):
        text = (root / build).read_text()
        assert all(f'-D{macro}' in text for macro in macros), build
    cmake = [line for line in (root / "CMakeLists.txt").read_text().splitlines()
             if line.startswith("target_compile_definitions(entropy_attn PRIVATE")]
    assert any(all(macro in line for macro in macros) for line in cmake)


def test_each_directory_compiles_as_one_unit_less_the_file_that_lifts_the_macro() -> None:
    """setup.py compiles each directory's host sources as one translation unit
    (build/unity/<directory>.cpp: unity_sources), as CMakeLists.txt does: every source is in its
    directory's unit once, so that none is left out (its operators would not be registered), and
    csrc/autocast.cpp, whose #undef would lift TORCH_ASSERT_ONLY_METHOD_OPERATORS for the files
    after it, compiles on its own in both builds, as python_module.cpp (Python.h first) does."""
    root = Path(__file__).resolve().parent.parent
    units = sorted((root / "build" / "unity").glob("*.cpp"))
    if not units:
        pytest.skip("no build/unity/: this tree was not built by setup.py")
    included = [line.split('"')[1] for unit in units for line in unit.read_text().splitlines()
                if line.startswith("#include")]
    lifted = {p.relative_to(root / "csrc").as_posix() for p in (root / "csrc").rglob("*.cpp")
              if "#undef TORCH_ASSERT_ONLY_METHOD_OPERATORS" in p.read_text()}
    standalone = lifted | {"python_module.cpp"}
    directories = {str(Path(f).parent) for f in included}
    expected = sorted(p.relative_to(root / "csrc").as_posix() for p in (root / "csrc").rglob("*.cpp")
                      if str(p.relative_to(root / "csrc").parent) in directories)
    assert sorted(included) == sorted(set(expected) - standalone)
    assert {".", "cpu"} <= directories, directories
    cmake = (root / "CMakeLists.txt").read_text()
    for name in lifted:  # (CMake's regex, with its dot escaped)
        escaped = name.replace(".", "\\\\.")
        assert f"/csrc/{escaped}$" in cmake, name


def _function_bodies(library: Path, objdump: str) -> dict[str, str]:
    """The disassembly of each function of ``library``, by demangled name."""
    listing = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(library)], capture_output=True,
                             text=True, check=True).stdout
    bodies: dict[str, list[str]] = {}
    current: list[str] = []
    for line in listing.splitlines():
        match = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if match:
            current = bodies.setdefault(match.group(1), [])
        elif line.strip():
            current.append(line)
    return {name: "\n".join(lines) for name, lines in bodies.items()}


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="checks the x86-64 clones of the row loops")
@pytest.mark.parametrize("loop,least", [("softmax_row", 8), ("weights_row", 8), ("dlogits_row", 2)])
def test_row_loops_vectorized_without_avx512(loop: str, least: int) -> None:
    """The exponential loops of the CPU kernels (csrc/cpu/row_kernels.cpp: the forward's p = e^(s - m)
    and the backward's p = e^(s - lse), float) are vector code in every ISA clone. Built without
    -fno-trapping-math (setup.py: VECTORIZE_FLAGS), GCC vectorized them only in the AVX-512 clone,
    whose masked instructions it may run the branch it makes of `x < lo ? 0 : e^x` with: the AVX2
    and baseline clones were scalar, and a float32 forward took 2.4x SDPA's time on an AVX2 CPU
    (1.2x with vector code). The exponential's polynomial alone is 8 multiplies per vector; the
    scalar clones had 0-2 packed multiplies. The backward's dS loop (dlogits_row, 3 multiplies per
    vector) was scalar in every clone. Multiplies counted as packed multiplies or fused multiply-adds
    of xmm/ymm registers (CFLAGS such as -march=x86-64-v3 make the baseline clone VEX-encoded and
    may fuse them)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to disassemble the library")
    bodies = _function_bodies(Path(torch_ext._C.__file__), objdump)
    clones = {name.rsplit("[clone .", 1)[1].rstrip("]"): body for name, body in bodies.items()
              if f"entropy_attn::cpu::{loop}(float*" in name and "[clone ." in name}
    if not clones:
        pytest.skip("the library has no ISA clones of the row loops (not built by GCC for x86-64)")
    # (the AVX-512 clone vectorized without the flag too)
    packed = r"\bv?(?:mul|fn?m(?:add|sub)\d*)ps\s+[^\n]*%[xy]mm"
    missing = [clone for clone in ("avx2", "default") if clone not in clones]
    assert not missing, f"{loop}(float) has no {missing} clone: {sorted(clones)}"
    counts = {clone: len(re.findall(packed, clones[clone])) for clone in ("avx2", "default")}
    assert all(n >= least for n in counts.values()), f"packed multiplies per clone of {loop}(float): {counts}"


def _scalar_bool_mask_maxima(body: str) -> int:
    """The scalar running maxima fed by a byte compare with 0 in a disassembled function: a
    conditional move right after a float compare (``mx = x > mx ? x : mx`` one key at a time) with
    ``cmpb $0x0`` (a bool mask's byte) among the 12 instructions before it."""
    instructions = [line.split(":", 1)[1].strip() if ":" in line else "" for line in body.splitlines()]
    return sum(1 for i, ins in enumerate(instructions)
               if ins.startswith("cmov")
               and any(re.match(r"v?ucomiss", w) for w in instructions[max(0, i - 3):i])
               and any(re.match(r"cmpb\s+\$0x0", w) for w in instructions[max(0, i - 12):i]))


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
                    reason="checks the x86-64 clones of the row loops")
def test_masked_logits_loop_vectorized() -> None:
    """The forward's logits under a bool mask (csrc/cpu/attention_cpu.h: masked_logits, inlined into
    softmax_row) are vector code in every ISA clone. With the mask's key stride a runtime value,
    GCC versioned the loop for stride 1 by itself and left that copy, the one every contiguous mask
    runs, scalar: a byte compare, a scalar multiply and a compare-and-cmov running max per key, which
    doubled the float32 forward's time under any mask (B=8, H=16, L=128, D=64: 10.6 ms against 4.6
    without a mask, SDPA 7.4; L=1024, D=128: 89 ms against 41). Each clone had one such loop."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump to disassemble the library")
    bodies = _function_bodies(Path(torch_ext._C.__file__), objdump)
    clones = {name.rsplit("[clone .", 1)[1].rstrip("]"): body for name, body in bodies.items()
              if "entropy_attn::cpu::softmax_row(float*" in name and "[clone ." in name
              and not name.endswith("resolver]")}
    if not clones:
        pytest.skip("the library has no ISA clones of the row loops (not built by GCC for x86-64)")
    scalar = {clone: _scalar_bool_mask_maxima(body) for clone, body in clones.items()}
    assert not any(scalar.values()), f"scalar bool-mask loops per clone of softmax_row(float): {scalar}"
