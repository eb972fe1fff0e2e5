"""nabla.onnx: run ONNX models eagerly on nabla, ONNX sharding annotations in and out, the ONNX sharding formalism's
validity checker and inference, and an ONNX backend. ``import nabla.onnx as nox`` (needs onnx)."""

try:
    import onnx  # noqa: F401 - the extra this package is built on
except ImportError:  # a missing extra names its pip command, as nb.jit names jax's
    raise ImportError("nabla.onnx needs onnx: pip install 'nabla-spmd[onnx]' (in a clone: pip install -e "
                      "'.[onnx]')") from None

from .specs import spec_from_onnx, spec_to_onnx
from .graph import run
from .check import check
from .annotate import annotate
from .backend import Backend, BackendRep
from .export import export

__all__ = ["run", "check", "annotate", "spec_from_onnx", "spec_to_onnx", "Backend", "BackendRep", "export"]
