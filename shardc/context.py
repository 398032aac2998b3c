"""The compile context every pass receives: the mesh and the options, frozen."""
from __future__ import annotations

from dataclasses import dataclass

from shardc.mesh import Mesh
from shardc.placement import Layout

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

GEMM_MODES = ("auto", "default", "NN", "NT", "TN")
BACKENDS = ("eager", "inductor")  # how the rank's program runs (shardc/backend.py)


@dataclass(frozen=True)
class Options:
    transpose_alternate: bool = True
    overlap: bool = True
    prefetch_depth: int = 1
    gemm_modes: str = "default"
    backend: str = "eager"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"shardc.compile: backend={self.backend!r} is not one of {BACKENDS}: 'eager' runs "
                "the rank's program op by op, 'inductor' compiles the compute between its "
                "collectives with torch.compile.")
        if self.gemm_modes not in GEMM_MODES:
            raise ValueError(
                f"shardc.compile: gemm_modes={self.gemm_modes!r} is not one of {GEMM_MODES}."
            )
        if self.gemm_modes != "default":
            # refuse rather than run the default form while claiming another
            raise NotImplementedError(
                f"shardc.compile: gemm_modes={self.gemm_modes!r} (timing NN/NT/TN per GEMM) is not "
                "implemented yet; every GEMM runs in PyTorch's default form. Use "
                "gemm_modes='default'.")
        if self.prefetch_depth < 0:
            raise ValueError(f"shardc.compile: prefetch_depth must be >= 0, got {self.prefetch_depth}.")


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
