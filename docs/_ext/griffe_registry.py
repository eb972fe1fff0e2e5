"""A griffe extension for the API reference: ``nb.<name>`` of every registered op is made from nabla's op
registry at import (``nabla.ops.registry``), which griffe, reading source, cannot see. Here each becomes an alias
of the function that defines it, or for a function the registry generated, a function with its runtime
signature and docstring. Likewise the methods set on ``Tensor`` and ``ShardingSpec`` by the modules above them
(``nabla.ops.methods``, ``numpy_api``, ``autodiff``, ``formats``), which their classes' source does not hold.
Loaded by mkdocs.yml (mkdocstrings' ``extensions``)."""

from __future__ import annotations

import inspect
from typing import Any

import griffe


def _function(name: str, fn: Any, labels: set[str] | None = None, method: bool = False) -> griffe.Function:
    """A griffe function of ``fn``'s runtime signature and docstring (``method``: its first parameter is the
    instance, whatever it is named, and is not shown)."""
    sig = inspect.signature(fn)
    if method:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    params = griffe.Parameters(*(griffe.Parameter(p.name, annotation=p.annotation,
                                                  kind=griffe.ParameterKind.positional_or_keyword,
                                                  default=None if p.default is p.empty else repr(p.default))
                                 for p in sig.parameters.values()))
    out = griffe.Function(name, parameters=params, returns=sig.return_annotation,
                          docstring=griffe.Docstring(fn.__doc__ or ""))
    out.labels |= labels or set()
    return out


def _attached_methods(pkg: griffe.Module) -> None:
    """The methods set on nabla's classes at import, added to their griffe classes."""
    from nabla.spec import ShardingSpec
    from nabla.tensor import Tensor

    for module, cls in (("tensor", Tensor), ("spec", ShardingSpec)):
        doc = pkg.members[module].members[cls.__name__]
        for name, attr in vars(cls).items():
            kind = "staticmethod" if isinstance(attr, staticmethod) else "property" if isinstance(attr, property) \
                else None
            fn = attr.__func__ if kind == "staticmethod" else attr.fget if kind == "property" else attr
            if name in doc.members or name.startswith("_") or not inspect.isfunction(fn):
                continue
            if kind == "property":  # shown as numpy's attributes are: ``T: Tensor``
                doc.set_member(name, griffe.Attribute(name, annotation=inspect.signature(fn).return_annotation,
                                                      docstring=griffe.Docstring(fn.__doc__ or "")))
                doc.members[name].labels.add("property")
                continue
            doc.set_member(name, _function(name, fn, {kind} if kind else None, method=kind is None))


class RegistryFunctions(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "nabla":
            return
        from nabla.ops import registry

        _attached_methods(pkg)

        for name in registry.names():
            if name in pkg.members:
                continue
            fn = registry.function(name)
            if fn.__module__ != "nabla":  # written as a def in an op family's module
                pkg.set_member(name, griffe.Alias(name, f"{fn.__module__}.{fn.__qualname__}"))
                continue
            pkg.set_member(name, _function(name, fn))
