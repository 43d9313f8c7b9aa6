"""Running Python from a source checkout puts its unbuilt `shoal/` folder ahead of the
installed package on the import path (`python -c ...`, `python -m ...` in the checkout
root). This finds the installed copy so `shoal/__init__.py` can hand over to it."""
import importlib.metadata
import importlib.util
import os
import sys


def unbuilt(package_dir):
    return not os.path.exists(os.path.join(package_dir, "_build_info.py"))


def load_installed(name, package_dir):
    """The installed package module (executed and registered in sys.modules), or None."""
    here = os.path.realpath(package_dir)
    # Every distribution of that name on the path (a checkout's own egg-info included).
    candidates = (os.path.realpath(str(d.locate_file(name)))
                  for d in importlib.metadata.Distribution.discover(name=name))
    installed = next((c for c in candidates if c != here and not unbuilt(c)), None)
    if installed is None:
        return None
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(installed, "__init__.py"), submodule_search_locations=[installed])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before executing: its submodules import "shoal.*"
    spec.loader.exec_module(module)
    return module
