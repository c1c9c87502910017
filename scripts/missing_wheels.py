"""Print the requirements that a folder of wheels leaves unmet on the Python running this.

Usage: python3 missing_wheels.py WHEELS REQUIREMENTS_FILE

scripts/build-images downloads the image's wheels with the host's pip for the image's Python
(``pip download --python-version 3.11``), but pip evaluates environment markers such as
``python_full_version < "3.11.3"`` against the host's interpreter, so a dependency that only
the image's exact release needs can be missing. This runs inside the image's base (the
target interpreter), walks the requirements through the wheels' metadata with the markers
evaluated there, and prints one unmet requirement a line (nothing when the folder is
complete). ``packaging`` is read from its wheel in the folder.
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import HeaderParser
from pathlib import Path


def main(folder: Path, requirements: Path) -> int:
    found = sorted(folder.glob("packaging-*.whl"))
    if not found:
        print(f"no packaging wheel in {folder} to read the requirements with", file=sys.stderr)
        return 2
    sys.path.insert(0, str(found[-1]))
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    wheels = {parse_wheel_filename(w.name)[0]: w for w in folder.glob("*.whl")}
    lines = requirements.read_text().splitlines()
    todo = [(Requirement(line), "") for line in lines if line.strip()]
    seen: set[tuple[str, str]] = set()
    missing: set[str] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        wheel = wheels.get(name)
        if wheel is None:
            missing.add(f"{req.name}{req.specifier}")
            continue
        wanted = [e for e in ["", *sorted(req.extras)] if (name, e) not in seen]
        if not wanted:
            continue
        seen.update((name, e) for e in wanted)
        with zipfile.ZipFile(wheel) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            headers = HeaderParser().parsestr(archive.read(meta).decode())
        for line in headers.get_all("Requires-Dist") or []:
            todo.extend((Requirement(line), e) for e in wanted)
    print("\n".join(sorted(missing)))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
