"""A griffe extension for the API reference: ``nb.<name>`` of every registered op is made from nabla's op
registry at import (``nabla.ops.registry``), which griffe, reading source, cannot see. Here each becomes an alias
of the function that defines it, or for a function the registry generated, a function with its runtime
signature and docstring. Loaded by mkdocs.yml (mkdocstrings' ``extensions``)."""

from __future__ import annotations

import inspect
from typing import Any

import griffe


class RegistryFunctions(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "nabla":
            return
        from nabla.ops import registry

        for name in registry.names():
            if name in pkg.members:
                continue
            fn = registry.function(name)
            if fn.__module__ != "nabla":  # written as a def in an op family's module
                pkg.set_member(name, griffe.Alias(name, f"{fn.__module__}.{fn.__qualname__}"))
                continue
            sig = inspect.signature(fn)
            params = griffe.Parameters(*(griffe.Parameter(p.name, annotation=p.annotation,
                                                          kind=griffe.ParameterKind.positional_or_keyword)
                                         for p in sig.parameters.values()))
            pkg.set_member(name, griffe.Function(name, parameters=params, returns=sig.return_annotation,
                                                 docstring=griffe.Docstring(fn.__doc__ or "")))
