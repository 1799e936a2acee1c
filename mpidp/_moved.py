"""Module paths that moved when the package took its folders (runtime, ops, parallel,
preflight): for one release the old path still imports, as the module at its new place, with
a ``DeprecationWarning`` naming that place. Nothing in mpidp imports an old path. Also the
packages' submodules on first use (:func:`submodule`)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

_FOLDERS = {
    "runtime": "bootstrap manager partition rng progress adopt",
    "ops": "collectives halo halo_plan geometry fft attention training skill sharding",
    "preflight": "validate explain plan",
    "parallel": "convert probe",
}

#: old module path -> where the module lives now
MOVED = {f"mpidp.{m}": f"mpidp.{folder}.{m}" for folder, ms in _FOLDERS.items() for m in ms.split()}
MOVED["mpidp.anemoi"] = "mpidp.compat.anemoi.legacy"  # it warns itself


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED` and hands out the module at its new place."""

    def find_spec(
        self, name: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = MOVED[spec.name]
        if spec.name != "mpidp.anemoi":
            warnings.warn(
                f"{spec.name} moved to {new}: import it from there (the old path goes after "
                f"one release)",
                DeprecationWarning,
                stacklevel=2,
            )
        return importlib.import_module(new)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing: the module ran at its new place."""


def submodule(package: str, name: str) -> types.ModuleType:
    """``package.name`` imported on first use (a package's ``__getattr__``: ``mpidp.ops.fft``
    after a plain ``import mpidp``, as when the flat package imported every module); an
    ``AttributeError`` when there is no such submodule."""
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{package}.{name}":  # the submodule exists; something it imports not
                raise
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def install() -> None:
    """Add the finder of old paths (once)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())
