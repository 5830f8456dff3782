"""Source files of a vLLM release, read out of its wheel on PyPI without downloading the
wheel (about 300 MB): HTTP range reads of the zip's central directory and of the members
asked for, each checked against its CRC-32 as zipfile reads it. Cached under
$KVHANDOFF_CACHE/vllm-src/<version>/ (default ~/.cache/kvhandoff)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
import zipfile

INDEX = "https://pypi.org/simple/vllm/"
CHUNK = 1 << 22


def cache_dir(version: str) -> str:
    root = os.environ.get("KVHANDOFF_CACHE") or os.path.expanduser("~/.cache/kvhandoff")
    return os.path.join(root, "vllm-src", version)


def _open(req: urllib.request.Request):
    for attempt in range(4):
        try:
            return urllib.request.urlopen(req, timeout=60)
        except OSError:
            if attempt == 3:
                raise
            time.sleep(2 ** attempt)


class _RemoteFile:
    """A read-only, seekable view of a file served over HTTP, read in 4 MiB ranges."""

    def __init__(self, url: str):
        self.url, self.pos, self._chunks = url, 0, {}
        self.size = int(_open(urllib.request.Request(url, method="HEAD")).headers["Content-Length"])

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = off if whence == 0 else self.pos + off if whence == 1 else self.size + off
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n < 0 else min(n, self.size - self.pos)
        out = bytearray()
        while n > 0:
            c = self.pos // CHUNK
            if c not in self._chunks:
                lo, hi = c * CHUNK, min(self.size, (c + 1) * CHUNK) - 1
                req = urllib.request.Request(self.url, headers={"Range": f"bytes={lo}-{hi}"})
                self._chunks = {c: _open(req).read()}
            b = self._chunks[c][self.pos - c * CHUNK:][:n]
            out += b
            self.pos += len(b)
            n -= len(b)
        return bytes(out)


def wheel_url(version: str) -> str:
    req = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    name = f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    for f in json.load(_open(req))["files"]:
        if f["filename"] == name:
            return f["url"]
    raise LookupError(f"{name} is not on {INDEX}")


def sources(version: str, modules: list[str]) -> str:
    """The directory holding the release's files for the dotted modules given (a module's
    .py, or its package's __init__.py; one the release lacks is simply absent)."""
    d = cache_dir(version)
    missing = [m for m in modules if not os.path.exists(os.path.join(d, ".have", m))]
    if not missing:
        return d
    z = zipfile.ZipFile(_RemoteFile(wheel_url(version)))
    names = set(z.namelist())
    for m in missing:
        base = m.replace(".", "/")
        for path in (base + ".py", base + "/__init__.py"):
            if path in names:
                dest = os.path.join(d, path)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                with open(dest + ".part", "wb") as f:
                    f.write(z.read(path))
                os.replace(dest + ".part", dest)
                break
        os.makedirs(os.path.join(d, ".have"), exist_ok=True)
        open(os.path.join(d, ".have", m), "w").close()
    return d
