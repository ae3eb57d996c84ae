"""scripts/device_bundle.sh install, on the GPU machine: the kernel harnesses that `make` packed as
one archive (the current kernels', the baseline's and the steps' between) come out executable under
build/, beside the packed library, when the bundle was made from these sources; from other sources,
no harness is unpacked. Which steps `make` builds (`history`), and when its virtual environment is
made again (`venv`)."""

from __future__ import annotations

import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
HARNESSES = ("kernel_harness", "kernel_harness_baseline", "kernel_harness_7ae3efb")


def make_tree(tmp_path: Path, bundle_sources: str) -> Path:
    """A tree with the script, a stand-in sources hash, a stand-in package and a bundle made from
    bundle_sources: the harnesses as make packs them, a library and its build info for this torch."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "device_bundle.sh", tmp_path / "scripts")
    (tmp_path / "scripts" / "sources_hash.sh").write_text("echo these-sources\n")
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    shutil.copy(ROOT / "csrc" / "cuda" / "cutlass_version.txt", tmp_path / "csrc" / "cuda")
    (tmp_path / "torch_ext").mkdir()
    (tmp_path / "torch_ext" / "__init__.py").write_text("__version__ = 'stub'\n")
    bundle = tmp_path / ".device"
    bundle.mkdir()
    (bundle / "sources.sha256").write_text(f"{bundle_sources}\n")
    (bundle / "baseline").write_text("d499297\n")
    (bundle / "steps").write_text("7ae3efb\n")
    (bundle / "arch").write_text("9.0\n")
    (bundle / "_build_info.py").write_text(f"TORCH_VERSION = '{torch.__version__.split('+')[0]}'\n")
    (bundle / "_C.abi3.so.xz").write_bytes(lzma.compress(b"library"))
    with tarfile.open(bundle / "harnesses.tar.xz", "w:xz") as tar:
        for name in HARNESSES:
            data = f"#!/bin/sh\necho {name}\n".encode()
            info = tarfile.TarInfo(f"./{name}")
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return tmp_path


def install(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", "scripts/device_bundle.sh", "install"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def test_install_unpacks_every_harness(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, "these-sources")
    done = install(tree)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in HARNESSES:
        ran = subprocess.run([str(tree / "build" / name)], capture_output=True, text=True)
        assert ran.stdout.strip() == name
    assert "with those of d499297 and of: 7ae3efb" in done.stdout
    assert (tree / "torch_ext" / "_C.abi3.so").read_bytes() == b"library"


def test_a_bundle_of_other_sources_unpacks_no_harness(tmp_path: Path) -> None:
    """(It then builds the library there, which this tree cannot: only the harnesses are checked.)"""
    tree = make_tree(tmp_path, "other-sources")
    assert "no packed library for these sources" in install(tree).stdout
    assert not any((tree / "build" / name).exists() for name in HARNESSES)


def test_history_keeps_the_steps_that_chain_from_the_baseline_to_head(tmp_path: Path) -> None:
    """`make` builds the harnesses of BASELINE and of the STEPS that lie, in the order given,
    between it and HEAD (`history` lists them): a step before the one given ahead of it, or HEAD
    itself, is left out with a message; a name that is no commit stops it."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "device_bundle.sh", tmp_path / "scripts")
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    shutil.copy(ROOT / "csrc" / "cuda" / "cutlass_version.txt", tmp_path / "csrc" / "cuda")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    commits = []
    for i in range(4):
        subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", f"c{i}"], cwd=tmp_path, check=True)
        commits.append(subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, check=True,
                                      capture_output=True, text=True).stdout.strip())

    def history(steps: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "BASELINE": commits[0], "STEPS": steps}
        return subprocess.run(["bash", "scripts/device_bundle.sh", "history"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)

    a, b, c, head = commits
    assert history(f"{b} {c}").stdout.strip() == f"baseline {a}, steps: {b} {c}"
    done = history(f"{c} {b} {head} {a}")
    assert done.stdout.strip() == f"baseline {a}, steps: {c}"
    assert all(f"step {x} left out" in done.stderr for x in (b, head, a))
    done = history(f"{b} nosuchcommit")
    assert done.returncode == 1 and "nosuchcommit names no commit" in done.stderr


def test_a_virtual_environment_cut_short_is_made_again(tmp_path: Path) -> None:
    """`venv` makes build/device/venv again where its making stopped before the end (torch in it,
    no stamp of the pins it was made with: CUTLASS's headers may be missing, as they were after an
    interrupted `make`) and keeps one made to the end. Stand-ins for python3 -m venv and pip log
    what they are asked."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "device_bundle.sh", tmp_path / "scripts")
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    shutil.copy(ROOT / "csrc" / "cuda" / "cutlass_version.txt", tmp_path / "csrc" / "cuda")
    stand_ins = tmp_path / "stand_ins"
    stand_ins.mkdir()
    log = tmp_path / "pip.log"
    # python3 -m venv DIR: a DIR whose python has "torch" of any version asked (exits 0) and whose
    # pip logs its arguments.
    (stand_ins / "python3").write_text(
        "#!/bin/bash\n"
        "[[ $1 == -m && $2 == venv ]] || exit 3\n"
        'mkdir -p "$3/bin"\n'
        "printf '#!/bin/bash\\nexit 0\\n' > \"$3/bin/python\"\n"
        f"printf '#!/bin/bash\\necho \"$*\" >> {log}\\n' > \"$3/bin/pip\"\n"
        'chmod +x "$3/bin/python" "$3/bin/pip"\n')
    (stand_ins / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{stand_ins}:{os.environ['PATH']}"}
    env.pop("DEVICE_VENV", None)

    def venv() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/device_bundle.sh", "venv"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)

    # A venv whose python has torch but that holds no stamp: made again, CUTLASS included.
    made = tmp_path / "build" / "device" / "venv"
    (made / "bin").mkdir(parents=True)
    (made / "bin" / "python").write_text("#!/bin/bash\nexit 0\n")
    (made / "bin" / "python").chmod(0o755)
    done = venv()
    assert done.returncode == 0, done.stdout + done.stderr
    installs = log.read_text().splitlines()
    assert len(installs) == 2 and "torch==2.11.0" in installs[0] and "nvidia-cutlass==" in installs[1]
    assert (made / "device_venv.pins").exists()
    # Made to the end: kept.
    log.unlink()
    done = venv()
    assert done.returncode == 0 and "virtual environment" not in done.stdout and not log.exists()
    # Other pins (another CUTLASS): made again.
    (tmp_path / "csrc" / "cuda" / "cutlass_version.txt").write_text("0.0.0\n")
    done = venv()
    assert done.returncode == 0 and "nvidia-cutlass==0.0.0" in log.read_text()


def test_the_harnesses_of_commits_are_built_once(tmp_path: Path) -> None:
    """`baseline` (as `make` after its own build) builds the harness of each commit, baseline and
    steps, once: a second run takes them from build/device/harness_cache, and other architectures
    build them again. Stand-ins: the virtual environment's python (setup.py) and each commit's
    scripts/kernel_harness.sh log their builds."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "device_bundle.sh", tmp_path / "scripts")
    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    shutil.copy(ROOT / "csrc" / "cuda" / "cutlass_version.txt", tmp_path / "csrc" / "cuda")
    log = tmp_path / "builds.log"
    (tmp_path / "scripts" / "kernel_harness.sh").write_text(
        f'mkdir -p build\nprintf "#!/bin/sh\\n" > build/kernel_harness\nchmod +x build/kernel_harness\n'
        f'echo "harness $(cat commit)" >> {log}\n')
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/bash\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    commits = []
    for i in range(3):
        (tmp_path / "commit").write_text(f"c{i}\n")
        subprocess.run(["git", "add", "-A", "scripts", "csrc", "commit"], cwd=tmp_path, check=True)
        subprocess.run(git + ["commit", "-q", "-m", f"c{i}"], cwd=tmp_path, check=True)
        commits.append(subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, check=True,
                                      capture_output=True, text=True).stdout.strip())
    harnesses = tmp_path / "build" / "device" / "harnesses"
    harnesses.mkdir(parents=True)
    (harnesses / "kernel_harness").write_text("#!/bin/sh\n")
    (harnesses / "kernel_harness").chmod(0o755)

    def baseline(arch: str = "9.0") -> subprocess.CompletedProcess:
        env = {**os.environ, "BASELINE": commits[0], "STEPS": commits[1], "DEVICE_VENV": str(venv),
               "DEVICE_ARCH": arch}
        return subprocess.run(["bash", "scripts/device_bundle.sh", "baseline"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    def packed() -> list[str]:
        with tarfile.open(tmp_path / ".device" / "harnesses.tar.xz") as tar:
            return sorted(tar.getnames())

    expected = sorted(["kernel_harness", "kernel_harness_baseline", f"kernel_harness_{commits[1]}"])
    for run in range(2):
        done = baseline()
        assert done.returncode == 0, done.stdout + done.stderr
        assert log.read_text().splitlines() == ["harness c0", "harness c1"]  # built in the first run only
        assert packed() == expected
    assert "built before" in done.stdout
    done = baseline("8.0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert log.read_text().splitlines()[2:] == ["harness c0", "harness c1"]
