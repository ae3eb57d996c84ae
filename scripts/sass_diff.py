"""Compares the machine code of two builds of the extension, function by function.

For each architecture both libraries hold, disassembles them (cuobjdump -sass) and reports how many
functions the two have in common, how many of those have the same instructions (parse says what
is left out of the comparison), which differ, and which exist in one build only. A build change
that should not change the code (the compiler flags that share one PTX between architectures, a
host-side refactoring) is checked this way; the table goes to stdout, Markdown.

    cp torch_ext/_C.abi3.so /tmp/before.so      # then change and rebuild
    python3 scripts/sass_diff.py /tmp/before.so torch_ext/_C.abi3.so
"""

from __future__ import annotations

import argparse
import concurrent.futures
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_check import architectures, tool  # noqa: E402


def parse(sass: str) -> dict[str, set[tuple[str, ...]]]:
    """Mangled function -> its distinct copies, each as its instructions, from cuobjdump -sass
    output. A template that several translation units instantiate (a kernel that launches from
    more than one unit) has a copy in each unit's cubin, all kept in the library: its copies are
    compared as a set, so that regrouping the units does not read as a change. Left out of the
    comparison: addresses, the ELF header flags (which name the virtual architecture the code was
    assembled from), the unit identifier and whitespace (cuobjdump's column widths vary, and the
    last function of a cubin is followed by a blank line the others lack)."""
    found: dict[str, set[tuple[str, ...]]] = {}
    name: str | None = None
    current: list[str] = []

    def close() -> None:
        if name is not None:
            found.setdefault(name, set()).add(tuple(current))

    for line in sass.splitlines():
        if m := re.match(r"\s*Function : (\S+)", line):
            close()
            name, current = m[1], []
        elif line.startswith("Fatbin "):  # the next fatbin entry's header (an embedded PTX's too)
            close()
            name, current = None, []
        elif name is not None and line.strip() and not re.match(r"\s*\.?(headerflags|identifier)", line):
            current.append(" ".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split()))
    close()
    return found


def functions(lib: Path, arch: str) -> dict[str, set[tuple[str, ...]]]:
    """Mangled function -> its distinct copies for one architecture (sm_90 includes sm_90a code)."""
    return parse(subprocess.run([tool("cuobjdump"), "-sass", "-arch", arch, str(lib)], capture_output=True,
                                text=True, check=True).stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    archs = sorted(architectures(args.before) & architectures(args.after))
    print("| arch | functions before | after | in both | same instructions | different | only before | only after |")
    print("|---|---|---|---|---|---|---|---|")
    differing: list[str] = []
    for arch in archs:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            before, after = pool.map(lambda lib: functions(lib, arch), (args.before, args.after))
        common = before.keys() & after.keys()
        different = sorted(name for name in common if before[name] != after[name])
        differing += [f"{arch} {name}" for name in different]
        print(f"| {arch} | {len(before)} | {len(after)} | {len(common)} | {len(common) - len(different)} | "
              f"{len(different)} | {len(before.keys() - after.keys())} | {len(after.keys() - before.keys())} |")
    for line in differing:
        print(f"\ndifferent: {line}", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
