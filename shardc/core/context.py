"""The compile context every pass receives: the mesh and the options, frozen; and the
``node.meta`` keys the passes write."""
from __future__ import annotations

from dataclasses import dataclass

from shardc.core.mesh import Mesh
from shardc.core.options import Options
from shardc.core.placement import Layout

# node.meta keys (listed with their invariants in passes/README.md)
PLACEMENT = "shardc_placement"  # Layout of the node's (global-shaped) value
GLOBAL_VAL = "shardc_global_val"  # the global tensor (fake/meta) this local node stands for
COMM = "shardc_comm"  # CommInfo of a collective node
KIND = "shardc_kind"  # "param" | "input" | "buffer" | "constant" | "local" | "collective" | ...
PARAM = "shardc_param"  # parameter name a placeholder holds
FALLBACK = "shardc_fallback"  # why this op ran replicated
SOURCE = "shardc_source"  # (op name, module path, source line) of the original node
REQUIRES_GRAD = "shardc_requires_grad"
PROGRAM = "shardc"  # gm.meta key: what the passes learnt (storage layouts, fallbacks, ...)

@dataclass(frozen=True)
class CompileContext:
    mesh: Mesh
    options: Options
    rt: str  # key of this program's runtime.collectives.Runtime
    # placeholder name of the traced graph -> (role, target): role is "param", "buffer",
    # "input" or "constant"; target the canonical parameter/buffer name
    roles: tuple[tuple[str, tuple[str, str]], ...] = ()
    trainable: frozenset[str] = frozenset()  # parameters that require grad
    rank: int = 0
    # placeholder name of a user input -> how it arrives on the ranks (default: dim 0
    # split over data and z); set by ``compile(..., input_layouts=...)``
    input_layouts: tuple[tuple[str, Layout], ...] = ()
    # user inputs whose example tensor requires grad: their gradient flows back to the
    # caller's local tensors, summed over the axes on which they are replicated
    grad_inputs: frozenset[str] = frozenset()

    @property
    def role_map(self) -> dict[str, tuple[str, str]]:
        return dict(self.roles)
