"""Small libraries compiled against an installed framework, once per framework version:
TensorFlow's kernels (bindings/tensorflow/shoal_tf_ops.cc) and torch's tensor access
(bindings/torch/torch_tensors.cc).

Each is compiled when first needed and cached under $SHOAL_CACHE_DIR (default
~/.cache/shoal) in a folder named after the framework's and Shoal's versions and a hash of
its source and Shoal's C headers: upgrading the framework triggers a rebuild instead of
loading a library built for another ABI. Ranks that import at the same time wait on a file
lock, so one builds and the others load its result."""
import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import shoal

PKG = Path(shoal.__file__).resolve().parent


def include_dir():
    """The folder holding shoal/c_api.h: installed with the package, or the checkout's."""
    for d in (PKG / "include", PKG.parent / "core" / "include"):
        if (d / "shoal" / "c_api.h").exists():
            return d
    raise ImportError("shoal: the C header shoal/c_api.h is missing from the installation")


def library(framework, source, filename, flags, what):
    """The path of `filename` built from `source` with `flags` (compiler and linker flags
    after the source) for `framework` ("tf-2.21.0"), building it first if needed.
    ImportError, naming `what`, without a C++ compiler or when the build fails."""
    headers = b"".join(p.read_bytes() for p in sorted((include_dir() / "shoal").glob("*.h")))
    # The package's path too: a library built for another installation links another libshoal.
    key = hashlib.sha256(Path(source).read_bytes() + headers + str(PKG).encode()).hexdigest()[:12]
    root = Path(os.environ.get("SHOAL_CACHE_DIR") or Path.home() / ".cache" / "shoal")
    folder = root / f"{framework}-shoal-{shoal.__version__}-{key}"
    out = folder / filename
    if out.exists():  # written whole (os.replace): a read-only cache serves as well
        return out
    failed = folder / "build-failed.txt"  # a failed build is not retried by every process
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if failed.exists():
                raise ImportError(f"{failed.read_text()}\n(remove {failed} to build again)")
            if not out.exists():
                print(f"shoal: building {what} (once) in {folder}", file=sys.stderr, flush=True)
                _build(Path(source), out, flags, what, failed)
    except OSError as exc:  # e.g. a read-only home: set SHOAL_CACHE_DIR
        raise ImportError(f"shoal: building {what} in {folder} failed: {exc} (set SHOAL_CACHE_DIR to a "
                          "writable folder)") from None
    return out


def _build(source, out, flags, what, failed):
    cxx = shlex.split(os.environ.get("CXX", "")) or [c for c in (shutil.which("c++") or shutil.which("g++"),) if c]
    if not cxx:
        raise ImportError(f"shoal: building {what} needs a C++ compiler (c++ or $CXX)")
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [*cxx, "-shared", "-fPIC", "-O2", "-Wno-deprecated-declarations", str(source), "-o", str(tmp),
           f"-I{include_dir()}", *flags]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # the compiler's fault, not the cache folder's; the next import tries again
        raise ImportError(f"shoal: building {what}: cannot run the C++ compiler {cxx[0]!r}: {exc}") from None
    if res.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        why = res.stderr[-4000:] if res.returncode != 0 else "the compiler wrote no library"
        failed.write_text(f"shoal: building {what} failed:\n{' '.join(cmd)}\n{why}")
        raise ImportError(failed.read_text())
    os.replace(tmp, out)
