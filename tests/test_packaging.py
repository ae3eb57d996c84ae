"""Packaging: the metadata of pyproject.toml, one version, the torch pin of a build, the source
distribution, the clear errors of a mismatched torch (at import) and of a missing torch (at
build), and each module's public names."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
import torch

import torch_ext

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_metadata() -> None:
    """pyproject.toml declares the build system and the project metadata; the version and the
    torch requirement come from setup.py (dynamic)."""
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert spec["build-system"]["build-backend"] == "setuptools.build_meta"
    assert any(r.startswith("torch") for r in spec["build-system"]["requires"])
    project = spec["project"]
    for key in ("name", "description", "readme", "license", "requires-python", "classifiers"):
        assert project.get(key), key
    assert set(project["dynamic"]) == {"version", "dependencies"}
    assert (ROOT / project["readme"]).exists() and (ROOT / "LICENSE").exists()


def test_version_is_written_once() -> None:
    """torch_ext.__version__ is torch_ext/_version.py's, and setup.py reports the same."""
    namespace: dict = {}
    exec((ROOT / "torch_ext" / "_version.py").read_text(), namespace)
    assert torch_ext.__version__ == namespace["__version__"]
    out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={**os.environ, "ENTROPY_ATTN_CPU_ONLY": "1"})
    assert out.stdout.strip().splitlines()[-1] == torch_ext.__version__


def test_build_records_the_torch_it_compiled_against() -> None:
    """The build info matches the running torch (major.minor), and setup.py pins that torch."""
    from torch_ext import _build_info

    assert _build_info.TORCH_VERSION.split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]
    code = "import runpy, sys; sys.argv = ['setup.py', '--version']; " \
           "g = runpy.run_path('setup.py', run_name='not_main'); print(g['torch_requirement']())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "ENTROPY_ATTN_CPU_ONLY": "1"})
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert out.stdout.strip().splitlines()[-1] == f"torch=={major}.{minor}.*"


def test_build_records_the_hash_of_its_sources() -> None:
    """The build info names the sources it was built from by scripts/sources_hash.sh's hash, which
    benchmark results record (benchmarks/gpu_vs_sdpa.py) to say which kernels they measured."""
    from torch_ext import _build_info

    assert re.fullmatch(r"[0-9a-f]{64}", _build_info.SOURCES_SHA256), _build_info.SOURCES_SHA256


def test_compile_caches_tell_builds_apart() -> None:
    """Importing torch_ext adds its build's source hash to torch.compiler.config.cache_key_tag,
    which torch.compile's caches put in every key: a graph compiled against another build of the
    operators (whose Meta kernels may lay out the gradients otherwise) is not replayed from a
    warm Inductor cache. A tag the user set stays, in front; importing again adds nothing."""
    from torch_ext import _build_info

    tag = f"torch_ext-{_build_info.SOURCES_SHA256[:16]}"
    assert tag in torch.compiler.config.cache_key_tag.split("+")
    code = ("import torch, torch_ext\ntorch_ext._tag_compile_caches()\n"
            "print(torch.compiler.config.cache_key_tag)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "TORCH_COMPILE_CACHE_KEY_TAG": "mine"})
    assert out.stdout.strip().splitlines()[-1] == f"mine+{tag}", out.stdout + out.stderr


def test_import_with_another_torch_is_one_clear_error() -> None:
    """Importing torch_ext under a torch of another minor version raises ImportError naming both
    versions (instead of an undefined-symbol error from the library)."""
    code = ("import torch; torch.__version__ = '2.99.0'\n"
            "try:\n    import torch_ext\nexcept ImportError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    line = out.stdout.strip()
    assert line.startswith("ERR"), out.stdout + out.stderr
    from torch_ext import _build_info

    assert "2.99.0" in line and _build_info.TORCH_VERSION in line and "--no-build-isolation" in line


def test_setup_without_torch_says_what_to_do() -> None:
    """setup.py in an environment without torch (pip's build isolation) exits with a sentence
    telling the user to install torch and build without isolation."""
    code = "import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; exec(open('setup.py').read())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode != 0
    assert "--no-build-isolation" in out.stderr and "Install torch" in out.stderr, out.stderr


def test_source_distribution_holds_what_the_build_reads(tmp_path: Path) -> None:
    """The sdist (MANIFEST.in) of the tracked files holds every file scripts/sources_hash.sh lists,
    what setup.py compiles and reads (it had no header and not the helpers setup.py imports, so
    that building it failed at once), and no build output: the hash of its sources is the tree's."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the tracked files)")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    src = tmp_path / "src"
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    env = {**os.environ, "ENTROPY_ATTN_CPU_ONLY": "1"}
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=src,
                   capture_output=True, check=True, env=env)
    (archive,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    files = {p.relative_to(unpacked).as_posix() for p in unpacked.rglob("*") if p.is_file()}
    csrc = {n for n in tracked.decode().split("\0") if n.startswith("csrc/")}
    assert csrc <= files, sorted(csrc - files)[:10]
    for name in ("setup.py", "pyproject.toml", "scripts/kernel_list.py", "scripts/cuda_home.py", "LICENSE"):
        assert name in files, name
    assert not any(n.endswith((".so", ".o")) or n.endswith("_build_info.py") for n in files), sorted(files)

    def sources_hash(tree: Path) -> str:
        return subprocess.run(["bash", str(tree / "scripts" / "sources_hash.sh")], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert sources_hash(unpacked) == sources_hash(src)


PUBLIC_MODULES = ("attention", "distributed", "hf", "merge", "monitor", "nn", "policy", "reductions", "sdpa",
                  "theory", "varlen")


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_star_import_gives_the_documented_names_only(name: str) -> None:
    """Each module lists its public names in ``__all__``: each exists and has a docstring, and
    ``from torch_ext.<module> import *`` brings those and not the module's own imports (``torch``,
    ``F``, ``Optional``...)."""
    module = importlib.import_module(f"torch_ext.{name}")
    names = module.__all__
    assert names and len(set(names)) == len(names)
    for public in names:
        assert getattr(module, public).__doc__, f"torch_ext.{name}.{public} has no docstring"
    space: dict = {}
    exec(f"from torch_ext.{name} import *", space)
    assert sorted(k for k in space if k != "__builtins__") == sorted(names)


def test_package_names_are_the_modules_names() -> None:
    """Each name ``torch_ext`` exports from one of its modules is in that module's ``__all__``."""
    for public in torch_ext.__all__:
        obj = getattr(torch_ext, public)
        home = getattr(obj, "__module__", None)
        if home is not None and home.startswith("torch_ext.") and not isinstance(obj, type(torch_ext)):
            assert public in importlib.import_module(home).__all__, f"{public} is not in {home}.__all__"
