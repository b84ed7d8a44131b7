"""The package's layout holds: small modules, imports that flow one way.

Imports are read from the source (module level and inside functions, since
a lazy import is a dependency too); imports under ``if TYPE_CHECKING:`` are
left out -- they never run, and are how a report or a file writer names the
``Plan`` it is handed without depending on it.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "autoddl_jax"
MAX_LINES = 400


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for f in sorted(PACKAGE.rglob("*.py")):
    parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = f
  return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
  lines = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      for sub in node.body:
        lines.update(range(sub.lineno, sub.end_lineno + 1))
  return lines


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
  tree = ast.parse(path.read_text())
  skip = _type_checking_lines(tree)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(tree):
    if getattr(node, "lineno", None) in skip:
      continue
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      # ``from pkg import mod`` depends on mod; ``from pkg import name``
      # on pkg (its __init__ defines the name).
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules
                 else base for a in node.names]
    else:
      continue
    for t in targets:
      if t in modules and t != name:
        out.add(t)
  return out


def _graph():
  modules = _modules()
  return {m: _imports(m, f, modules) for m, f in modules.items()}


def test_no_module_is_over_the_size_limit():
  big = {m: n for m, f in _modules().items()
         if (n := len(f.read_text().splitlines())) > MAX_LINES}
  assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_no_import_cycle_inside_the_package():
  # The package node is its __init__: a module it imports (directly or
  # not) that imports a name from the package closes a cycle through it.
  inner = _graph()
  state: dict[str, int] = {}  # 1: on the stack, 2: done
  cycles = []

  def visit(m, stack):
    state[m] = 1
    for d in sorted(inner.get(d_ := m, ())):
      if state.get(d) == 1:
        cycles.append(stack[stack.index(d):] + [d])
      elif d not in state:
        visit(d, stack + [d])
    state[d_] = 2

  for m in sorted(inner):
    if m not in state:
      visit(m, [m])
  assert not cycles, "import cycles: " + "; ".join(
      " -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_lazy_import(tmp_path, monkeypatch):
  # The check above must be able to fail: two modules importing each
  # other, one of them inside a function.
  pkg = tmp_path / "autoddl_jax"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "_a.py").write_text("from autoddl_jax import _b\n")
  (pkg / "_b.py").write_text("def f():\n  from autoddl_jax._a import g\n")
  monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
  with pytest.raises(AssertionError, match="_a -> autoddl_jax._b -> "):
    test_no_import_cycle_inside_the_package()


def test_the_planner_does_not_import_the_reference_models():
  graph = _graph()
  users = [m for m, deps in graph.items() if not m.startswith(
      "autoddl_jax.testing") and any(d.startswith("autoddl_jax.testing")
                                     for d in deps)]
  assert not users, users
