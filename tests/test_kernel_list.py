"""The CUDA kernel instantiation list (csrc/cuda/kernels.toml) and the files generated from it.

No GPU is needed: these check the list itself, that the checked-in translation units and dispatch
tables are what scripts/generate_kernels.py makes of it, and that the build compiles exactly those.
"""

from __future__ import annotations

import re
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
            entries = [re.fullmatch(r"(EA_UNTESTED\()?X\((.*)\)(?(1)\)) \\", line.strip())
                       for line in section.splitlines() if "X(" in line]
            assert all(entries), section
            listed = sorted((m[2], m[1] is not None) for m in entries)
            assert listed == sorted((i.template_args(), i.on_request) for i in insts if i.direction == direction)


@pytest.mark.parametrize("builder", ["setup.py", "CMakeLists.txt"])
def test_builds_compile_the_generated_units(builder: str) -> None:
    """setup.py and CMake take every .cu under csrc/cuda recursively, so the generated units are
    built (setup.py less those of instantiations compiled on request, unless asked for);
    scripts/ptxas_report.py checks that the built library holds code from each."""
    text = (ROOT / builder).read_text()
    assert "csrc/cuda/**/*.cu" in text or "GLOB_RECURSE ENTROPY_ATTN_CUDA_SOURCES" in text
    on_disk = {p for p in (ROOT / "csrc" / "cuda").rglob("*.cu") if p.parent.name == "instantiations"}
    assert on_disk == set(kernel_list.translation_units())
    assert "kernel_list.on_request_units()" in text or builder == "CMakeLists.txt"


def test_untested_instantiations_are_compiled_on_request(tmp_path: Path) -> None:
    """An `on_request` entry of kernels.toml (a capability written without a GPU, off by default
    until tested on one: csrc/cuda/untested_kernels.h) marks instantiations whose units compile
    them only under ENTROPY_ATTN_UNTESTED_KERNELS, the dispatch lists wrap them in EA_UNTESTED, a
    build without them leaves out the units that hold only those, and the build info tells the
    reports which build they read. (On this tree's list with the sm80 family's head dim 256 put on
    request too, as it was until it passed on a GPU.)"""
    text = kernel_list.LIST.read_text()
    section = text.index("[sm80]")
    exclude = text.index("\nexclude = ", section)
    spec = tmp_path / "kernels.toml"
    spec.write_text(text[:exclude] + "\non_request = [{ head_dim = 256 }]" + text[exclude:])
    insts = kernel_list.load(spec)
    requested = {i for fam in insts.values() for i in fam if i.on_request}
    assert all(i.on_request for i in insts["sm80"] if i.head_dim == 256)
    units = kernel_list.on_request_units(insts)
    assert units == {kernel_list.unit_path(i) for i in requested}
    files = kernel_list.generated_files(insts)
    for unit in units:
        assert f"#ifdef {kernel_list.UNTESTED_MACRO}" in files[unit] and files[unit].count("template ") >= 3
    dispatch = files[ROOT / "csrc" / "cuda" / "sm80" / "instantiations" / "dispatch.h"]
    assert dispatch.count("EA_UNTESTED(X(") == len([i for i in requested if i.family == "sm80"])
    everything = set(kernel_list.translation_units(families=insts))
    assert everything - set(kernel_list.translation_units(untested=False, families=insts)) == units
    header = (ROOT / "csrc" / "cuda" / "untested_kernels.h").read_text()
    assert f"#ifdef {kernel_list.UNTESTED_MACRO}" in header and "#define EA_UNTESTED(...)" in header
    info = tmp_path / "_build_info.py"
    assert not kernel_list.built_with_untested_kernels(info), "no build info: a build without them"
    info.write_text("TORCH_VERSION = '2.14.1'\nUNTESTED_KERNELS = False\n")
    assert not kernel_list.built_with_untested_kernels(info)
    info.write_text("TORCH_VERSION = '2.14.1'\nUNTESTED_KERNELS = True\n")
    assert kernel_list.built_with_untested_kernels(info)


def test_on_request_entries_are_checked(tmp_path: Path) -> None:
    """An `on_request` entry with an unknown key is an error naming it, as an `exclude` entry."""
    spec = tmp_path / "kernels.toml"
    spec.write_text('[sm80]\ndirections = ["forward"]\ndtypes = ["bfloat16"]\nhead_dims = [64]\n'
                    'on_request = [{ head = 64 }]\n')
    with pytest.raises(ValueError, match="on_request entry"):
        kernel_list.load(spec)


def test_tensor_core_families_compile_head_dim_256() -> None:
    """The sm80 family lists head dim 256 (Gemma's), forward and backward, with the flags of its
    general (causal) instantiations at the other head dims, which take full attention too
    (family.cpp); the Hopper family lists both directions at 256 as at 128, compiled on request."""
    insts = kernel_list.load()
    sm80 = insts["sm80"]
    for direction in ("forward", "backward"):
        general = {(i.dtype, i.mask, i.stats) for i in sm80 if i.direction == direction and i.causal}
        at_256 = [i for i in sm80 if i.direction == direction and i.head_dim == 256]
        assert all(i.causal for i in at_256), direction
        assert {(i.dtype, i.mask, i.stats) for i in at_256} == general, direction
    sm90_256 = [i for i in insts["sm90"] if i.head_dim == 256]
    assert sm90_256 and all(i.on_request for i in sm90_256)
    flags = lambda d: {(i.direction, i.dtype, i.causal, i.mask, i.stats)  # noqa: E731
                       for i in insts["sm90"] if i.head_dim == d}
    assert flags(256) == flags(128)


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


def test_sass_check_flags_serialized_wgmma() -> None:
    """sass_check's gate on ptxas's wgmma serialization: a Hopper kernel whose HGMMA each close a
    wgmma group (gsb0) of their own fails; batches of several k-steps, as the kernels have, pass."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import collections

    import sass_check

    name = ("entropy_attn::cuda::sm90::fwd_impl::forward_kernel<__nv_bfloat16, "
            "entropy_attn::cuda::sm90::fwd_impl::FwdTraits<__nv_bfloat16, 128, (entropy_attn::MaskKind)0>, "
            "false, (entropy_attn::MaskKind)0, true>(args)")
    base = {"UTMALDG.2D": 4, "SYNCS.PHASECHK.TRANS64.TRYWAIT": 4, "USETMAXREG.DEALLOC.CTAPOOL": 1,
            "MUFU.EX2": 64}
    batched = collections.Counter({**base, "HGMMA.64X128X16.F32.BF16": 32, sass_check.GROUP_ENDS: 4})
    assert sass_check.check(name, batched) == []
    serialized = collections.Counter({**base, "HGMMA.64X128X16.F32.BF16": 32, sass_check.GROUP_ENDS: 32})
    assert sass_check.check(name, serialized) == ["wgmma serialized: 32 of 32 HGMMA close a group of their own"]


def test_share_ptx_groups_architectures_between_changes() -> None:
    """share_ptx compiles the architectures that no change of the code separates from one PTX, the
    lowest of them, and leaves PTX and architecture-specific targets as torch listed them."""
    def gencode(virtual: int, real: int | str) -> str:
        return f"-gencode=arch=compute_{virtual},code=sm_{real}"

    torch_flags = [gencode(80, 80), gencode(90, 90)]
    assert kernel_list.share_ptx(torch_flags, ()) == [gencode(80, 80), gencode(80, 90)]
    assert kernel_list.share_ptx(torch_flags, (90,)) == torch_flags
    assert kernel_list.share_ptx(torch_flags, (80,)) == [gencode(80, 80), gencode(80, 90)]
    wide = [gencode(75, 75), gencode(80, 80), gencode(86, 86), gencode(90, 90),
            "-gencode=arch=compute_90,code=compute_90", "-gencode=arch=compute_90a,code=sm_90a"]
    # "+PTX": the embedded PTX is the shared one (compiled anyway), listed once.
    with_ptx = torch_flags + ["-gencode=arch=compute_90,code=compute_90"]
    assert kernel_list.share_ptx(with_ptx, ()) == [gencode(80, 80), gencode(80, 90),
                                                   "-gencode=arch=compute_80,code=compute_80"]
    assert kernel_list.share_ptx(with_ptx, (90,)) == with_ptx
    assert kernel_list.share_ptx(wide, (80, 90)) == [
        gencode(75, 75), gencode(80, 80), gencode(80, 86), gencode(90, 90),
        "-gencode=arch=compute_90,code=compute_90", "-gencode=arch=compute_90a,code=sm_90a"]


def _included_sources(header: Path) -> set[Path]:
    """header and the files of this project it includes, transitively (quoted includes)."""
    seen: set[Path] = set()
    todo = [header]
    while todo:
        path = todo.pop().resolve()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.MULTILINE):
            todo.append(path.parent / name)
    return seen


def test_ptx_changes_match_the_sources() -> None:
    """A family's declared `ptx_changes_at` (per direction) is exactly the set of N in the
    `__CUDA_ARCH__ >= N` tests of the sources its launch header includes, and those sources test
    the architecture no other way: otherwise architectures that share a PTX (setup.py) would run
    code written for another one."""
    declared = kernel_list.ptx_changes()
    assert ("sm80", "forward") in declared and ("sm80", "backward") in declared
    for (family, direction), capabilities in declared.items():
        header = ROOT / "csrc" / "cuda" / family / kernel_list.launch_header(direction).removeprefix("../")
        found: set[int] = set()
        for source in _included_sources(header):
            text = source.read_text()
            found |= {int(n) // 10 for n in re.findall(r"__CUDA_ARCH__\s*>=\s*(\d+)", text)}
            other = re.findall(r"__CUDA_ARCH__\s*(?:[<>!=]=?)\s*\d+|__CUDA_ARCH_(?:FEAT|SPECIFIC|FAMILY)\w*", text)
            assert all(">=" in test for test in other), (source, other)
        floor = {kernel_list.min_archs()[family]} if family in kernel_list.min_archs() else set()
        assert found == set(capabilities) - floor, (family, direction, found, capabilities)


def test_shared_ptx_units_for_sm80_and_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """For setup.py's default TORCH_CUDA_ARCH_LIST (8.0;9.0+PTX) the sm80 family's units, forward
    and backward, compile one PTX (compute_80) for both architectures and embed it, as setup.py
    passes them to nvcc; the fallback declares nothing (one each)."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    assert re.search(r'"TORCH_CUDA_ARCH_LIST", "8\.0;9\.0\+PTX"', (ROOT / "setup.py").read_text())
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    arch_flags = cpp_extension._get_cuda_arch_flags()
    assert sorted(arch_flags) == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=compute_90",
                                  "-gencode=arch=compute_90,code=sm_90"]
    units = kernel_list.shared_ptx_units()
    shared = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_80,code=sm_90",
              "-gencode=arch=compute_80,code=compute_80"]
    for direction in ("forward", "backward"):
        sm80 = [p for p in units if p.parent.parent.name == "sm80" and p.name.startswith(direction)]
        assert sm80 and all(sorted(kernel_list.share_ptx(arch_flags, units[p])) == sorted(shared) for p in sm80)
    assert not any(p.parent.parent.name == "fallback" for p in units)
    # A direction that declares sm_90 keeps one PTX per architecture.
    assert kernel_list.share_ptx(arch_flags, (90,)) == arch_flags


def test_no_sm80_target_shares_a_ptx_below_sm80(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a TORCH_CUDA_ARCH_LIST that reaches below 8.0 (as containers preset it), no sm80 unit
    assembles an sm_80-or-newer target, nor the embedded PTX, from a PTX below compute_80: CuTe
    compiles its SM80 atoms to traps there, and share_ptx once built every sm80 forward's sm_80 and
    sm_86 machine code from compute_75."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    assert kernel_list.min_archs() == {"sm80": 80}
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5;8.0;8.6;9.0+PTX")
    arch_flags = cpp_extension._get_cuda_arch_flags()
    units = kernel_list.shared_ptx_units()
    assert {p.parent.parent.name for p in units} == {"sm80"}
    for path, changes in units.items():
        for flag in kernel_list.share_ptx(arch_flags, changes):
            virtual, kind, real = re.fullmatch(r"-gencode=arch=compute_(\d+),code=(sm|compute)_(\d+)", flag).groups()
            assert int(virtual) >= 80 or int(real) < 80, (path.name, flag)
    forward = next(p for p in units if p.name.startswith("forward"))
    assert "-gencode=arch=compute_80,code=sm_86" in kernel_list.share_ptx(arch_flags, units[forward])


def test_one_unit_per_direction_and_head_dim() -> None:
    """Each translation unit holds every instantiation of one family, direction and head dim,
    whatever their dtypes and flags (each unit pays nvcc's fixed costs once, and the flags'
    instantiations share their tile types, which cicc then instantiates once:
    scripts/kernel_list.py, Instantiation.unit_name)."""
    for family, insts in kernel_list.load().items():
        units: dict[Path, set[tuple[str, int]]] = {}
        for inst in insts:
            units.setdefault(kernel_list.unit_path(inst), set()).add((inst.direction, inst.head_dim))
        assert all(len(keys) == 1 for keys in units.values()), family
        assert len(units) == len({(i.direction, i.head_dim) for i in insts}), family
    sm80 = [p.name for p in kernel_list.translation_units() if p.parent.parent.name == "sm80"]
    assert len(sm80) == 6 and "backward_hd64.cu" in sm80


def test_masked_full_attention_runs_in_the_general_instantiations() -> None:
    """The tensor-core families list no plain (non-causal) masked instantiation: for each of their
    masked instantiations there is a general one with the same dtype, head dim, mask and
    statistics, which family.cpp gives masked full attention."""
    for family in ("sm80", "sm90"):
        insts = kernel_list.load()[family]
        assert not any(i.mask != "none" and not i.causal for i in insts), family
        general = {(i.direction, i.dtype, i.head_dim, i.mask, i.stats) for i in insts if i.causal}
        assert all((i.direction, i.dtype, i.head_dim, i.mask, i.stats) in general for i in insts), family
    source = (ROOT / "csrc" / "cuda" / "family.cpp").read_text()
    for name in ("sm80_forward", "sm80_backward", "sm90_forward", "sm90_backward"):
        body = " ".join(source.split(f" {name}(", 1)[1].split("\n}\n")[0].split())
        assert f"return causal ? nullptr : {name}(dtype, d, true," in body, name


def test_ptx_changes_needs_one_list_per_direction(tmp_path: Path) -> None:
    """A `ptx_changes_at` that misses a direction (or sits beside a `gencode`) is an error naming
    the key, not a silent shared PTX."""
    spec = tmp_path / "kernels.toml"
    spec.write_text('[f]\ndirections = ["forward", "backward"]\ndtypes = ["float16"]\nhead_dims = [64]\n'
                    'ptx_changes_at = { forward = [] }\n')
    with pytest.raises(ValueError, match="ptx_changes_at"):
        kernel_list.ptx_changes(spec)
    spec.write_text('[f]\ndirections = ["forward"]\ndtypes = ["float16"]\nhead_dims = [64]\n'
                    'ptx_changes_at = { forward = [90, 80] }\n')
    assert kernel_list.ptx_changes(spec) == {("f", "forward"): (80, 90)}


def test_sass_diff_compares_instructions_only() -> None:
    """scripts/sass_diff.py's parse keeps each function's instructions and leaves out what differs
    between builds of the same code: addresses, the header flags naming the virtual architecture,
    the unit identifier, column widths, and the header of an embedded PTX that follows; a function
    with a copy in several units' cubins is compared by its distinct copies."""
    import sass_diff

    def dump(virtual: str, unit: str, pad: str) -> str:
        return (f"\tcode for sm_90\n\t.headerflags @\"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_{virtual})\"\n"
                f"\t\tFunction : _Z1kv\n\tidentifier = {unit}\n"
                f"        /*0000*/{pad}IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ; /* 0x00000a00ff017624 */\n"
                f"        /*0010*/{pad}EXIT ;\n\nFatbin ptx code:\n================\narch = sm_90\n")

    a = sass_diff.parse(dump("SM80", "a.cu", "  "))
    b = sass_diff.parse(dump("SM90", "b.cu", "      "))
    assert a == b and [list(copy) for copy in a["_Z1kv"]] == [
        ["IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ; /* 0x00000a00ff017624 */", "EXIT ;"]]
    c = sass_diff.parse(dump("SM90", "b.cu", " ").replace("EXIT", "BRA 0x10"))
    assert c != a
    # The same function in two units' cubins: two identical copies are one; a differing copy counts.
    assert sass_diff.parse(dump("SM80", "a.cu", " ") + dump("SM80", "b.cu", "  ")) == a
    assert len(sass_diff.parse(dump("SM80", "a.cu", " ") + dump("SM80", "b.cu", " ").replace("EXIT", "BRA 0x10"))["_Z1kv"]) == 2
