"""Build the Docker sandbox tests' image on this machine: no registry, no Dockerfile.

The image is a root filesystem made here from a *statically linked* busybox (Debian/Ubuntu:
``apt-get install busybox-static``) -- ``/bin/busybox`` plus a symlink per applet, ``/etc/passwd``
with ``root`` and ``agent`` (uid 1000), and the directories a container needs -- fed to the
daemon with ``docker import`` (the SDK's ``import_image_from_data``). The tag carries a hash of
the busybox binary, so a rebuilt busybox gives a new image and an existing one is reused.

CI::

    apt-get install -y docker.io busybox-static
    dockerd > /tmp/dockerd.log 2>&1 &
    until docker info > /dev/null 2>&1; do sleep 1; done
    python -m tests.sandbox.docker_image        # optional: the fixture builds it on demand
    TEST_REQUIRE_DOCKER=require pytest tests/sandbox
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPOSITORY = "rollout-sandbox-test"
BUSYBOX_ENV = "ROLLOUT_TEST_BUSYBOX"
"""Path of a static busybox to use instead of looking one up."""

_PT_INTERP = 3


def is_static_elf(path: Path) -> bool:
    """True for a 64-bit little-endian ELF executable with no program interpreter."""
    try:
        with path.open("rb") as handle:
            header = handle.read(64)
            if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
                return False
            phoff = struct.unpack_from("<Q", header, 32)[0]
            phentsize, phnum = struct.unpack_from("<HH", header, 54)
            for index in range(phnum):
                handle.seek(phoff + index * phentsize)
                (kind,) = struct.unpack("<I", handle.read(4))
                if kind == _PT_INTERP:
                    return False
    except (OSError, struct.error):
        return False
    return True


def find_static_busybox() -> Path | None:
    candidates = [os.environ.get(BUSYBOX_ENV), shutil.which("busybox"), "/bin/busybox"]
    for candidate in candidates:
        if candidate and is_static_elf(Path(candidate).resolve()):
            return Path(candidate).resolve()
    return None


def _applets(busybox: Path) -> list[str]:
    listed = subprocess.run(
        [str(busybox), "--list"], check=True, capture_output=True, text=True
    ).stdout
    return sorted({name for name in listed.split() if name and "/" not in name} - {"busybox"})


def rootfs_tar(busybox: Path) -> bytes:
    """An uncompressed tar of the image's root filesystem."""
    buffer = io.BytesIO()
    now = int(time.time())

    def add(name: str, *, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime = kind, mode, now
        if link:
            info.linkname = link
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        archive.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for directory in ("bin", "etc", "dev", "proc", "sys", "root", "home", "workspace"):
            add(directory, kind=tarfile.DIRTYPE, mode=0o755)
        add("tmp", kind=tarfile.DIRTYPE, mode=0o1777)
        add("bin/busybox", kind=tarfile.REGTYPE, mode=0o755, data=busybox.read_bytes())
        for applet in _applets(busybox):
            add(f"bin/{applet}", kind=tarfile.SYMTYPE, mode=0o777, link="busybox")
        passwd = (
            "root:x:0:0:root:/root:/bin/sh\n"
            "agent:x:1000:1000:agent:/home:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/:/bin/false\n"
        )
        group = "root:x:0:\nagent:x:1000:\nnogroup:x:65534:\n"
        add("etc/passwd", kind=tarfile.REGTYPE, mode=0o644, data=passwd.encode())
        add("etc/group", kind=tarfile.REGTYPE, mode=0o644, data=group.encode())
    return buffer.getvalue()


def image_tag(busybox: Path) -> str:
    digest = hashlib.sha256(busybox.read_bytes()).hexdigest()[:12]
    return f"{REPOSITORY}:busybox-{digest}"


def ensure_image(client: Any, busybox: Path) -> str:
    """The test image's tag, importing it into the daemon first if it is missing."""
    docker = __import__("docker")
    tag = image_tag(busybox)
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    repository, _, version = tag.partition(":")
    client.api.import_image_from_data(rootfs_tar(busybox), repository=repository, tag=version)
    client.images.get(tag)
    return tag


def main() -> int:
    import docker

    busybox = find_static_busybox()
    if busybox is None:
        print("no statically linked busybox found: apt-get install busybox-static", file=sys.stderr)
        return 1
    client = docker.from_env()
    print(ensure_image(client, busybox))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
