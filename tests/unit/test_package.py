"""``import mpidp`` is cheap and complete: names load on first use (PEP 562), so ``mpidp --help``
answers without torch, and every public name is the object its module defines, listed by
``dir()`` and ``__all__``, and seen by type checkers (the ``TYPE_CHECKING`` imports)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import mpidp

INIT = Path(mpidp.__file__)


def _fresh(code: str) -> str:
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return res.stdout.strip()


def test_import_and_help_load_no_torch():
    code = (
        "import contextlib, io, sys\n"
        "import mpidp, mpidp.cli\n"
        "print('torch' in sys.modules)\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "    mpidp.cli.main(['--help'])\n"
        "print('torch' in sys.modules, 'subcommands' in out.getvalue())\n"
    )
    assert _fresh(code).splitlines() == ["False", "False True"]


def test_the_type_checking_imports_are_the_lazy_table():
    """The names mypy sees (the ``if TYPE_CHECKING:`` imports) and the names __getattr__
    resolves, module by module, are one list."""
    tree = ast.parse(INIT.read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
    )
    imported: dict[str, set[str]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom)
        if node.module == "mpidp":  # the submodules, imported whole
            names = {a.asname or a.name for a in node.names}
            assert names <= set(mpidp._SUBMODULES), names
            continue
        if node.module == "mpidp.ops":  # a short name for one that lives in a folder
            names = {a.asname or a.name for a in node.names}
            assert names <= set(mpidp._SHORT), names
            continue
        imported.setdefault(str(node.module), set()).update(a.name for a in node.names)
    assert imported == {m: set(names) for m, names in mpidp._SOURCES.items()}
    assert sorted(mpidp.__all__) == sorted([*mpidp._MODULE_OF, "__version__"])


def test_every_public_name_resolves_to_its_module_object():
    listed = set(dir(mpidp))
    for name in mpidp.__all__:
        assert name in listed, name
        if name != "__version__":
            module = importlib.import_module(mpidp._MODULE_OF[name])
            assert getattr(mpidp, name) is getattr(module, name), name
    for sub in mpidp._SUBMODULES:
        path = mpidp._SHORT.get(sub, f"mpidp.{sub}")
        assert getattr(mpidp, sub) is importlib.import_module(path) and sub in listed
    with pytest.raises(AttributeError, match="module 'mpidp' has no attribute 'nope'"):
        mpidp.nope  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute '_private'"):
        mpidp._private  # noqa: B018


def test_any_submodule_loads_on_first_use():
    """As when ``import mpidp`` imported every module: ``mpidp.io.save_checkpoint`` after a
    plain ``import mpidp``."""
    code = "import mpidp\nprint(mpidp.io.save_checkpoint.__module__, mpidp.layers.__name__)"
    assert _fresh(code) == "mpidp.io.checkpoint mpidp.layers"


def test_from_import_of_every_name_in_a_fresh_process():
    names = ", ".join(n for n in mpidp.__all__ if n != "__version__")
    assert _fresh(f"from mpidp import {names}\nfrom mpidp import *\nprint('ok')") == "ok"
