"""llama.cpp's own test data, from the ``llama-cpp-python`` sdist on PyPI: vocab-only GGUFs of real models with
``.inp`` texts and ``.out`` token ids (``models/``), and real chat templates (``models/templates/``).

The sdist is fetched once from PyPI's simple index, its sha256 checked, and only ``vendor/llama.cpp/models/``
unpacked into ``$PAGEDKV_TEST_CACHE`` (default ``~/.cache/pagedkv_rs-tests``). Where it cannot be fetched the tests
fail with the command that fetches it by hand; they never skip.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
INDEX = "https://pypi.org/simple/llama-cpp-python/"
MEMBER_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDKV_TEST_CACHE", Path.home() / ".cache" / "pagedkv_rs-tests"))


def _fetch_hint(dest: Path) -> str:
    return (
        f"llama.cpp's test data is missing. Fetch it with: pip download --no-deps --no-binary :all: "
        f"llama-cpp-python==0.3.36 -d {dest.parent} (or set PAGEDKV_TEST_CACHE to a folder holding {SDIST})"
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(dest: Path) -> None:
    page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
    urls = [u for u in re.findall(r'href="([^"]+)"', page) if SDIST in u]
    if not urls:
        raise RuntimeError(f"{SDIST} is not listed at {INDEX}")
    tmp = dest.with_suffix(".part")
    with urllib.request.urlopen(urls[0].split("#", 1)[0], timeout=300) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    tmp.replace(dest)


def models_dir() -> Path:
    """``vendor/llama.cpp/models`` of the sdist, fetched and unpacked on first use."""
    root = cache_dir()
    out = root / "llama.cpp-0.3.36-models"
    if (out / ".complete").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / SDIST
    try:
        if not sdist.exists() or _sha256(sdist) != SDIST_SHA256:
            _download(sdist)
        if _sha256(sdist) != SDIST_SHA256:
            raise RuntimeError(f"{sdist}: sha256 differs from {SDIST_SHA256}")
    except Exception as e:
        raise RuntimeError(f"{_fetch_hint(sdist)} ({type(e).__name__}: {e})") from e
    stage = Path(tempfile.mkdtemp(dir=root))
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith(MEMBER_PREFIX):
                rel = m.name[len(MEMBER_PREFIX) :]
                target = stage / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    (stage / ".complete").touch()
    if out.exists():
        shutil.rmtree(out)
    stage.replace(out)
    return out


def vocab_files() -> list[Path]:
    """Every ``ggml-vocab-*.gguf`` that has an ``.inp`` / ``.out`` pair beside it."""
    d = models_dir()
    return sorted(p for p in d.glob("ggml-vocab-*.gguf") if Path(f"{p}.inp").exists() and Path(f"{p}.out").exists())


def templates_dir() -> Path:
    return models_dir() / "templates"
