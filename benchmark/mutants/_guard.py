"""pytest plugin of the mutants runner (run.py, `-p _guard`): refuse to run the tests unless the
mutated module is the copy's. The checkout is installed editable into the venv, so a PYTHONPATH that
stopped winning would test the unmutated checkout and report every mutant as a survivor (or, worse,
a stale copy as killed)."""
from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest


def pytest_configure(config):
    root, name = os.environ.get("HISTATE_MUTANT_ROOT"), os.environ.get("HISTATE_MUTANT_MODULE")
    if not root or not name:
        return
    module = importlib.import_module(name)
    where = Path(module.__file__).resolve()
    if not where.is_relative_to(Path(root).resolve()):
        raise pytest.UsageError(f"HISTATE_MUTANT_GUARD: {name} imported from {where}, not from the copy {root}")
