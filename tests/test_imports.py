"""The import graph of the package (shoal/ and the bindings and launcher setup.py maps
into it) has no cycle, counting imports inside functions too (read with ast, nothing is
imported); and the Python side keeps no mutable module-level state outside
shoal._process.STATE."""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _packages():
    """setup.py's packages, each with its folder (package_dir, else below its parent's)."""
    call = next(n for n in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("packages", "package_dir")}
    out = {}
    for package in kw["packages"]:
        parent, _, last = package.rpartition(".")
        out[package] = kw["package_dir"].get(package) or f"{out[parent]}/{last}"
    return out


PACKAGES = _packages()  # package -> folder


def modules():
    """{module name: path} of every Python file of the package."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _package_of(name, path):
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports(name, path, known):
    """The package's modules that module `name` imports, anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package_of(name, path).split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    found.add(sub)  # `from pkg import submodule`
                elif base in known:
                    found.add(base)  # a name defined in module `base`
    found.discard(name)
    # Importing a submodule runs its parent packages' __init__ first; that is not an
    # edge of the cycle kind (the parent is already being imported), so drop it.
    return {m for m in found if not name.startswith(m + ".")}


def graph():
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycle(g):
    """One cycle of `g` as a list of modules, or None."""
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_is_read():
    g = graph()
    assert "shoal._ops" in g["shoal.basics"] and "shoal._process" in g["shoal._ops"]
    assert "shoal._ops" in g["shoal.torch._ops"] and "shoal._hierarchical" in g["shoal.tensorflow.ops"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    # Every Python file below the package folders is a module of the graph.
    files = {p for folder in set(PACKAGES.values()) for p in (ROOT / folder).rglob("*.py")}
    assert files == set(modules().values()), sorted(map(str, files - set(modules().values())))


def test_no_import_cycle():
    found = cycle(graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def _mutable(value):
    return isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
        isinstance(value, ast.Call) and getattr(value.func, "attr", getattr(value.func, "id", "")) in (
            "dict", "list", "set", "count", "local", "WeakKeyDictionary", "WeakValueDictionary",
            "defaultdict", "OrderedDict", "deque"))


def test_no_module_level_mutable_state():
    # Module-level containers are allowed when they are constants (ALL_CAPS, or __all__);
    # anything else that can change lives in shoal._process.STATE, which shutdown() resets.
    offenders = []
    for name, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and _mutable(node.value):
                for t in node.targets:
                    if isinstance(t, ast.Name) and not (t.id.isupper() or t.id.lstrip("_").isupper()
                                                         or t.id == "__all__"):
                        offenders.append(f"{name}.{t.id} (line {node.lineno})")
    assert not offenders, "module-level mutable state outside shoal._process.STATE: " + ", ".join(offenders)


_COMPILE = """
import importlib.util
import sys
{first}
import torch
import shoal.torch as bf
print("torch._dynamo" in sys.modules)
importlib.util.find_spec("torch._dynamo")  # an availability probe: must not lose the substitutions
bf.init()
print(torch.compile(lambda x: bf.allreduce(x * 2, name="c"), fullgraph=True)(torch.ones(3)).tolist())
"""


@pytest.mark.parametrize("first", ["", "import torch._dynamo"])
def test_shoal_torch_imports_dynamo_only_for_torch_compile(first):
    # Importing dynamo costs ~2 s per process: shoal.torch leaves it to torch.compile, whose
    # full graph (no break at the C entry points) needs the substitutions registered whether
    # dynamo came first or later.
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", _COMPILE.format(first=first)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == [str(bool(first)), "[2.0,", "2.0,", "2.0]"], out.stdout
