"""The pure core imports nothing heavy and does no I/O or wall-clock reads (DESIGN.md layering)."""
import ast
import subprocess
import sys
from pathlib import Path

import histate.core

CORE = Path(histate.core.__file__).parent
ALLOWED = {"__future__", "bisect", "collections", "dataclasses", "enum", "heapq", "itertools", "math", "sys", "typing"}


def test_core_modules_import_only_the_standard_library_subset():
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module.split(".")[0]]
            else:
                continue
            bad = [n for n in names if n not in ALLOWED]
            assert not bad, f"{path.relative_to(CORE)} imports {bad}"
            assert "time" not in names and "os" not in names


def test_core_imports_with_torch_and_sglang_blocked():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['sglang'] = None; sys.modules['numpy'] = None\n"
            "import histate.core as c; print(len(c.available_policies()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == len(histate.core.available_policies())


def _top_level_imports(path: Path) -> set:
    """Module-level imports (a function may import an optional dependency lazily, on demand)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_plugin_imports_sglang_and_the_simulator_needs_no_torch():
    package = CORE.parent
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        imports = _top_level_imports(path)
        if rel.parts[0] != "sglang_plugin":
            assert "sglang" not in imports, f"histate/{rel} imports sglang (only sglang_plugin may)"
        if rel.parts[0] in ("sim", "core", "storage") or rel.name == "cli.py":
            assert "torch" not in imports, f"histate/{rel} imports torch"


def _core_imports(path: Path, package: Path):
    """(line, module, names) of every import of histate.core made by `path` (absolute or relative)."""
    rel_parts = path.relative_to(package).parts if path.is_relative_to(package) else ()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # resolve `from ..core.x import y` against the file's package
                base = ("histate",) + rel_parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ((node.module,) if node.module else ()))
            else:
                module = node.module or ""
            if module == "histate.core" or module.startswith("histate.core."):
                yield node.lineno, module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("histate.core."):
                    yield node.lineno, alias.name, []


def test_executors_import_only_the_cores_public_names():
    """One policy engine: the simulator, the reference executor, the SGLang plugin, the CLI and the
    benchmarks reach the core only through `histate.core.__all__`, never through its submodules, so
    every shared piece of policy machinery is visible in one place (issue 9)."""
    package = CORE.parent
    public = set(histate.core.__all__)
    files = [p for p in package.rglob("*.py") if p.relative_to(package).parts[0] != "core"]
    files += list((package.parents[1] / "benchmark").glob("*.py"))
    offenders = []
    for path in files:
        for lineno, module, names in _core_imports(path, package):
            if module != "histate.core" or not set(names) <= public:
                offenders.append(f"{path.name}:{lineno} imports {module} {names}")
    assert not offenders, "imports of histate.core outside its __all__:\n" + "\n".join(offenders)



def _imported_test_modules(path: Path, test_modules: set) -> list:
    """(line, name) of every absolute import in `path` that names a test module or the `test` package,
    and of every `importlib.import_module` / `__import__` call with such a literal name. Relative imports
    stay inside their own package, so they cannot reach test/."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "__import__"))):
            names = [node.args[0].value]
        else:
            continue
        hits += [(node.lineno, n) for n in names if n.split(".")[0] in test_modules | {"test"}]
    return hits


def test_nothing_outside_the_test_suite_imports_test_modules():
    """Benchmarks and the package must not depend on test/ (its CPU stubs are a test bootstrap only).
    Every file is checked, not only those that edit sys.path: an installed test package, a PYTHONPATH or
    the current directory can make such an import work without any sys.path line in the file."""
    root = CORE.parents[2]
    test_modules = {p.stem for p in (root / "test").rglob("*.py")} - {"__init__", "conftest"}
    files = list((root / "python").rglob("*.py")) + list((root / "benchmark").rglob("*.py"))
    assert len(files) > 50  # the walk found the tree (a wrong root would check nothing)
    offenders = [f"{path.relative_to(root)}:{line} imports {name}"
                 for path in files for line, name in _imported_test_modules(path, test_modules)]
    assert not offenders, "modules outside test/ import test code:\n" + "\n".join(offenders)


def test_the_package_never_reaches_the_cpu_stubs():
    """The triton/torchvision stubs (sglang_cpu/) are for tests and benchmarks: no histate module
    imports them, so a server never runs on stubs."""
    package = CORE.parent
    offenders = [f"histate/{p.relative_to(package)}" for p in package.rglob("*.py")
                 if "sglang_cpu" in _top_level_imports(p) | {n.split(".")[0] for n in _all_imports(p)}]
    assert not offenders, offenders


def _all_imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names
