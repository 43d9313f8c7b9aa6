"""The C entry points' torch tensor access (shoal/torch_tensors.h) and the optimizers'
bucket copies: torch_tensors.cc, compiled against the installed torch once per torch
version (shoal/_compiled.py).

Shoal's own build does not compile against torch (docs/design.md §2), so one build serves
every torch; this library is the only part that does, built at first import like the
TensorFlow kernels. Without a C++ compiler it is absent, said once on stderr, and plain
tensors are read through torch's Python API instead (about 4 us more per op)."""
import functools
import importlib.util
import sys
import sysconfig
from pathlib import Path

import torch

from shoal import _compiled

SOURCE = Path(__file__).resolve().parent / "torch_tensors.cc"


@functools.lru_cache(maxsize=None)
def module():
    """The compiled shoal_torch_tensors module, or None where it cannot be built."""
    lib = Path(torch.__file__).resolve().parent / "lib"
    flags = ["-std=c++20", f"-I{lib.parent / 'include'}", f"-I{sysconfig.get_paths()['include']}",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-L{lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    version = f"torch-{torch.__version__}-{(torch.version.git_version or '')[:12]}"
    name = "shoal_torch_tensors" + sysconfig.get_config_var("EXT_SUFFIX")
    try:
        path = _compiled.library(version, SOURCE, name, flags, f"tensor access for torch {torch.__version__}")
        spec = importlib.util.spec_from_file_location("shoal_torch_tensors", path)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
    except ImportError as exc:
        print(f"{exc}\nshoal.torch: reading tensors through torch's Python API instead (slower per op)",
              file=sys.stderr, flush=True)
        return None
    return m


def table():
    """The shoal_torch_tensors capsule, or None where the library cannot be built."""
    m = module()
    return None if m is None else m.table
