"""The packages import downward only, so the train path reads in one look (docs/architecture.md):
configs import ml_collections and configs; data, model and parallelism never import the
trainer (data neither model); and inside `trainer/` each sub-package imports only those
below it, in the order of `trainer/__init__.py`."""

import ast
import os

import pytest

import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = {"configs": ("trainer", "data", "model", "parallelism", "jax"),
             "parallelism": ("trainer", "data"), "model": ("trainer",),
             "data": ("trainer", "model")}


def _imports(path: str) -> list[tuple[int, str]]:
  """(line, module) of every import in a file, `from a import b` as 'a.b'."""
  out = []
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      out += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
  return out


def _files(package: str):
  for folder, _, names in os.walk(os.path.join(ROOT, package)):
    for name in sorted(names):
      if name.endswith(".py"):
        yield os.path.join(folder, name)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_the_top_packages_import_downward(package):
  wrong = [f"{os.path.relpath(path, ROOT)}:{line} imports {module}"
           for path in _files(package) for line, module in _imports(path)
           if module.split(".")[0] in FORBIDDEN[package]]
  assert not wrong, wrong


def test_each_trainer_package_imports_only_the_ones_below_it():
  order = trainer.LAYERS
  assert sorted(order) == sorted(name for name in os.listdir(os.path.join(ROOT, "trainer"))
                                 if os.path.isfile(os.path.join(ROOT, "trainer", name,
                                                                "__init__.py")))
  wrong = []
  for rank, package in enumerate(order):
    for path in _files(os.path.join("trainer", package)):
      for line, module in _imports(path):
        parts = module.split(".")
        if parts[0] == "trainer" and (len(parts) < 3 or parts[1] not in order
                                      or order.index(parts[1]) > rank):
          wrong.append(f"{os.path.relpath(path, ROOT)}:{line} imports {module}")
  assert not wrong, wrong
