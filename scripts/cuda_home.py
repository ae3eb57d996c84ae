"""The CUDA toolkit root that setup.py builds with, and that scripts/device_bundle.sh checks against.

    python3 scripts/cuda_home.py        # prints it (nothing, and exit 1, when there is no toolkit)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys


def cuda_home() -> str | None:
    """The CUDA toolkit root: $CUDA_HOME or $CUDA_PATH, else asked from nvcc (PATH, then
    /usr/local/cuda/bin). nvcc may be a wrapper script (/usr/local/bin/nvcc) outside the toolkit,
    where torch's own guess (the directory above nvcc) is wrong; its dry run prints the root."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
    if nvcc is None:
        return None
    dry_run = subprocess.run([nvcc, "-dryrun", "-E", "-x", "cu", os.devnull],
                             capture_output=True, text=True, check=False)
    top = re.search(r"^#\$ TOP=(.+)$", dry_run.stderr, re.MULTILINE)
    return os.path.realpath(top.group(1)) if top else None


if __name__ == "__main__":
    home = cuda_home()
    if home is None:
        sys.exit(1)
    print(home)
