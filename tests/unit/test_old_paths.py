"""The module paths that moved into the package's folders (runtime, ops, parallel, preflight)
still import for one release: the same module object, with a DeprecationWarning that names the
new path. mpidp itself imports no old path (a fresh interpreter with the warning made an error
imports the package and every subpackage)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from mpidp._moved import MOVED


@pytest.mark.parametrize("old", sorted(set(MOVED) - {"mpidp.anemoi"}))
def test_an_old_path_is_the_module_at_its_new_place(old):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert any(f"{old} moved to {MOVED[old]}" in m for m in messages), messages


def test_the_package_imports_no_old_path():
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import mpidp, mpidp.models, mpidp.io, mpidp.graph, mpidp.compat.credit, "
        "mpidp.compat.physicsnemo, mpidp.compat.anemoi, mpidp.preflight.plan, "
        "mpidp.preflight.explain, mpidp.preflight.validate, mpidp.testing, mpidp.cli\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
