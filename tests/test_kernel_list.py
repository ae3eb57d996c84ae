"""The CUDA kernel instantiation list (csrc/cuda/kernels.toml) and the files generated from it.

No GPU is needed: these check the list itself, that the checked-in translation units and dispatch
tables are what scripts/generate_kernels.py makes of it, and that the build compiles exactly those.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import kernel_list  # noqa: E402


def test_generated_files_are_up_to_date() -> None:
    """`generate_kernels.py --check` passes: no generated file is missing, stale or edited."""
    proc = subprocess.run([sys.executable, "scripts/generate_kernels.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_detects_an_edited_file(tmp_path: Path) -> None:
    """The check fails when a generated file differs (so the test above can fail). It edits a copy
    of the generated folders (--root), never this tree: a build running meanwhile would see the
    edit, and every later build recompiles the file (its time stamp moved)."""
    for folder in {path.parent for path in kernel_list.generated_files()}:
        shutil.copytree(folder, tmp_path / folder.relative_to(ROOT))

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "scripts/generate_kernels.py", "--check", "--root", str(tmp_path)],
                              cwd=ROOT, capture_output=True, text=True, check=False)

    assert check().returncode == 0, "the copy is up to date"
    path, text = next(iter(kernel_list.generated_files(root=tmp_path).items()))
    path.write_text(text + "// edited\n")
    proc = check()
    assert proc.returncode == 1 and path.name in proc.stdout, proc.stdout


def test_fallback_covers_every_dtype_and_head_dim_bucket() -> None:
    """The fallback serves every call the tensor-core family does not: all four dtypes at head-dim
    buckets 64 and 128 (256 for all but float64), forward and backward, flags at run time."""
    insts = kernel_list.load()["fallback"]
    for direction in ("forward", "backward"):
        have = {(i.dtype, i.head_dim) for i in insts if i.direction == direction}
        for dtype in kernel_list.DTYPES:
            for d in (64, 128) + (() if dtype == "float64" else (256,)):
                assert (dtype, d) in have, (direction, dtype, d)
    assert all(i.causal is None and i.mask is None and i.stats is None for i in insts)


def test_tensor_core_flags_are_compile_time() -> None:
    """The sm80 family's instantiations carry causality, the mask kind and (forward) the
    statistics as template arguments: each combination listed once."""
    insts = kernel_list.load()["sm80"]
    fwd = [i for i in insts if i.direction == "forward"]
    bwd = [i for i in insts if i.direction == "backward"]
    assert len(set(insts)) == len(insts)
    assert all(i.causal is not None and i.mask is not None and i.stats is not None for i in fwd)
    assert all(i.causal is not None and i.mask is not None and i.stats is None for i in bwd)
    assert all(i.dtype in ("bfloat16", "float16") for i in insts)


def test_hopper_family_compiles_for_sm90a_alone() -> None:
    """The sm90 family (wgmma, setmaxnreg: sm_90a only) names its one target in kernels.toml, and
    every unit it generates gets exactly that -gencode (setup.py's BuildExtensionPerUnitTarget);
    its flags are compile-time, as sm80's (the statistics flag in the forward only)."""
    assert kernel_list.gencodes() == {"sm90": "arch=compute_90a,code=sm_90a"}
    units = kernel_list.gencode_units()
    assert all(p.parent.parent.name == "sm90" for p in units)
    assert set(units.values()) <= {"-gencode=arch=compute_90a,code=sm_90a"}
    insts = kernel_list.load()["sm90"]
    fwd = [i for i in insts if i.direction == "forward"]
    bwd = [i for i in insts if i.direction == "backward"]
    assert fwd and bwd
    assert all(None not in (i.causal, i.mask, i.stats) for i in fwd)
    assert all(None not in (i.causal, i.mask) and i.stats is None for i in bwd)


def test_dispatch_table_lists_every_instantiation() -> None:
    """Each family's dispatch.h names each instantiation once, with its template arguments."""
    files = kernel_list.generated_files()
    for family, insts in kernel_list.load().items():
        table = files[ROOT / "csrc" / "cuda" / family / "instantiations" / "dispatch.h"]
        for direction in ("forward", "backward"):
            section = table.split(f"EA_{family.upper()}_{direction.upper()}_KERNELS(X)")[1].split("#define")[0]
            listed = sorted(line.strip()[2:-3] for line in section.splitlines() if line.strip().startswith("X("))
            assert listed == sorted(i.template_args() for i in insts if i.direction == direction)


@pytest.mark.parametrize("builder", ["setup.py", "CMakeLists.txt"])
def test_builds_compile_the_generated_units(builder: str) -> None:
    """setup.py and CMake take every .cu under csrc/cuda recursively, so the generated units are
    built; scripts/ptxas_report.py checks that the built library holds code from each."""
    text = (ROOT / builder).read_text()
    assert "csrc/cuda/**/*.cu" in text or "GLOB_RECURSE ENTROPY_ATTN_CUDA_SOURCES" in text
    on_disk = {p for p in (ROOT / "csrc" / "cuda").rglob("*.cu") if p.parent.name == "instantiations"}
    assert on_disk == set(kernel_list.translation_units())


def test_tensor_core_families_compile_head_dim_256() -> None:
    """The sm80 family lists head dim 256 (Gemma's), forward and backward, with the flags of its
    general (causal) instantiations at the other head dims, which take full attention too
    (family.cpp); the Hopper family does not list it (such calls go to sm80)."""
    insts = kernel_list.load()
    sm80 = insts["sm80"]
    for direction in ("forward", "backward"):
        general = {(i.dtype, i.mask, i.stats) for i in sm80 if i.direction == direction and i.causal}
        at_256 = [i for i in sm80 if i.direction == direction and i.head_dim == 256]
        assert all(i.causal for i in at_256), direction
        assert {(i.dtype, i.mask, i.stats) for i in at_256} == general, direction
    assert all(i.head_dim != 256 for i in insts["sm90"])


def test_exclude_matches_instantiations(tmp_path: Path) -> None:
    """An `exclude` entry drops exactly the instantiations that match all its keys (flags
    included); an unknown key is an error naming the entry."""
    spec = tmp_path / "kernels.toml"
    spec.write_text('[f]\ndirections = ["forward", "backward"]\ndtypes = ["float16"]\nhead_dims = [64, 256]\n'
                    'causal = [false, true]\nmasks = ["none", "bool"]\n'
                    'exclude = [{ head_dim = 256, causal = false }, { direction = "backward", mask = "bool" }]\n')
    insts = kernel_list.load(spec)["f"]
    assert len(insts) == 2 * 2 * 2 * 2 - 4 - 3  # 16, less 4 at D = 256 not causal, less 3 more backward bool
    assert not any(i.head_dim == 256 and not i.causal for i in insts)
    assert not any(i.direction == "backward" and i.mask == "bool" for i in insts)
    spec.write_text('[f]\ndirections = ["forward"]\ndtypes = ["float16"]\nhead_dims = [64]\n'
                    'exclude = [{ headdim = 64 }]\n')
    with pytest.raises(ValueError, match="headdim"):
        kernel_list.load(spec)


def test_ptxas_report_holds_tensor_core_kernels_to_no_spills() -> None:
    """A tensor-core family's kernel must not spill at any head dim; the fallback's may at 256."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import ptxas_report

    def kernel(name: str) -> "ptxas_report.Kernel":
        k = ptxas_report.Kernel(file="x.cu", arch="sm_80", mangled=name, name=name)
        k.bucket = ptxas_report.first_int_template_arg(name)
        return k

    assert kernel("entropy_attn::cuda::sm80::fwd_impl::split_combine_kernel<__half, 256, true>").must_not_spill
    assert kernel("entropy_attn::cuda::sm90::bwd_impl::postprocess_kernel<__half, 256>").must_not_spill
    assert kernel("entropy_attn::cuda::fallback::attention_fwd_kernel<__half, 128>").must_not_spill
    assert not kernel("entropy_attn::cuda::fallback::attention_fwd_kernel<__half, 256>").must_not_spill
