"""Builds (once per TensorFlow version) and loads the TensorFlow kernel library.

The kernels are compiled against the TensorFlow that is installed when they are first
needed, and cached under $SHOAL_CACHE_DIR (default ~/.cache/shoal) in a folder named after
the TensorFlow and Shoal versions: upgrading TensorFlow triggers a rebuild instead of
loading a library built for another ABI. Ranks that import at the same time wait on a
file lock, so one builds and the others load its result.
"""
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import tensorflow as tf

import shoal

HERE = Path(__file__).resolve().parent
PKG = Path(shoal.__file__).resolve().parent
SOURCE = HERE / "shoal_tf_ops.cc"


def _cache_dir():
    root = Path(os.environ.get("SHOAL_CACHE_DIR") or Path.home() / ".cache" / "shoal")
    # The C ABI header too: a kernel built against another layout of shoal_op_desc would
    # hand the core garbage in the fields it lacks.
    header = (_include_dir() / "shoal" / "c_api.h").read_bytes()
    key = hashlib.sha256(SOURCE.read_bytes() + header + str(PKG).encode()).hexdigest()[:12]
    return root / f"tf-{tf.__version__}-shoal-{shoal.__version__}-{key}"


def _include_dir():
    for d in (PKG / "include", PKG.parent / "core" / "include"):  # installed, or source checkout
        if (d / "shoal" / "c_api.h").exists():
            return d
    raise ImportError("shoal.tensorflow: the C header shoal/c_api.h is missing from the installation")


def build(out):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise ImportError("shoal.tensorflow needs a C++ compiler (c++ or $CXX) to build its TensorFlow "
                          "kernels once for this TensorFlow version")
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, "-shared", "-fPIC", "-O2", "-Wno-deprecated-declarations", str(SOURCE), "-o", str(tmp), f"-I{_include_dir()}",
           *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags(),
           f"-L{PKG}", "-lshoal", f"-Wl,-rpath,{PKG}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ImportError(f"shoal.tensorflow: building the TensorFlow kernels failed:\n{' '.join(cmd)}\n"
                          f"{res.stderr[-4000:]}")
    os.replace(tmp, out)


def load():
    """The loaded op library (tf.load_op_library), building it first if needed."""
    d = _cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    lib = d / "libshoal_tf.so"
    with open(d / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            print(f"shoal.tensorflow: building kernels for TensorFlow {tf.__version__} (once) in {d}",
                  file=sys.stderr, flush=True)
            build(lib)
    return tf.load_op_library(str(lib))
