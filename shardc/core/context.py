"""The compile context every pass receives: the mesh and the options, frozen."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardc.core.mesh import Mesh
from shardc.core.placement import Layout
from shardc.core.precision import as_precision

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
CHECKPOINT_POLICIES = ("none", "blocks")
BACKENDS = ("eager", "inductor")  # how the rank's program runs (shardc/program/backend.py)


# torch DDP's defaults: bucket_cap_mb, and the first bucket when that is left unset
# (dist._DEFAULT_FIRST_BUCKET_BYTES)
DEFAULT_BUCKET_MB = 25.0
FIRST_BUCKET_MB = 1.0


@dataclass(frozen=True)
class Options:
    transpose_alternate: bool = True
    overlap: bool = True
    prefetch_depth: int = 1
    gemm_modes: str = "default"
    # run forward and backward as one traced program (passes/joint.py) so the step
    # passes can move and pack backward collectives; False: autograd's own backward
    step_graph: bool = True
    # size of the buckets the post-backward gradient reductions are packed into (MiB);
    # 0 reduces each gradient on its own; None is DDP's default (see bucket_bytes)
    bucket_mb: float | None = None
    # gather weights again in backward instead of keeping forward's (FSDP2's default
    # memory behaviour); needs step_graph
    reshard_after_forward: bool = False
    activation_checkpoint: Any = "none"
    # "fp32", "bf16" or a shardc.Precision; a Precision after construction
    precision: Any = "fp32"
    shard_optimizer: bool = False
    backend: str = "eager"
    # a GEMM dim that its mesh axis does not divide (a 3-class head on x=2): False keeps
    # that dim whole on that axis (every rank of it computes the product); True refuses
    # it, as the planner asks (its pattern analysis drops meshes that do not divide the
    # model, DESIGN.md). Not a compile() option.
    refuse_indivisible: bool = False

    @property
    def bucket_bytes(self) -> int:
        """The cap on a bucket, in bytes (0: no buckets)."""
        return int((DEFAULT_BUCKET_MB if self.bucket_mb is None else self.bucket_mb) * 2 ** 20)

    @property
    def first_bucket_bytes(self) -> int:
        """The cap on the first bucket: DDP's rule. Left at the default, the first bucket
        closes at 1 MiB, so the last layers' gradients go out while backward still has most
        of the model to do; a size the user gives caps every bucket, the first too (as
        DDP's ``bucket_cap_mb`` does), which saves a collective a step where overlap buys
        nothing: 8 gloo ranks sharing 2 cores (README, "Step time against torch's own
        parallelisms")."""
        if self.bucket_mb is None:
            return min(self.bucket_bytes, int(FIRST_BUCKET_MB * 2 ** 20))
        return self.bucket_bytes

    @property
    def recompute(self) -> bool:
        """Does the program recompute blocks in backward ("blocks" or a selective policy)?"""
        return bool(self.activation_checkpoint != "none")

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", as_precision(self.precision))
        object.__setattr__(self, "activation_checkpoint",
                           _as_checkpoint_policy(self.activation_checkpoint))
        if self.backend not in BACKENDS:
            raise ValueError(
                f"shardc.compile: backend={self.backend!r} is not one of {BACKENDS}: 'eager' runs "
                "the rank's program op by op, 'inductor' compiles the compute between its "
                "collectives with torch.compile.")
        if self.gemm_modes not in GEMM_MODES:
            raise ValueError(
                f"shardc.compile: gemm_modes={self.gemm_modes!r} is not one of {GEMM_MODES}."
            )
        if self.gemm_modes != "default" and (not self.step_graph or self.backend != "eager"
                                             or self.recompute):
            # the forms are a pass of the whole-step program: refuse rather than run the
            # traced forms while claiming others
            raise ValueError(
                f"shardc.compile: gemm_modes={self.gemm_modes!r} rewrites the GEMMs of the "
                "whole-step program, which step_graph=False and block or selective recompute "
                "do not run, and backend='inductor' picks its own layouts; use "
                "gemm_modes='default' with them.")
        if self.reshard_after_forward and not self.step_graph:
            raise ValueError("shardc.compile: reshard_after_forward=True re-gathers weights inside "
                             "the whole-step program; it needs step_graph=True.")
        if self.bucket_mb is not None and self.bucket_mb < 0:
            raise ValueError(f"shardc.compile: bucket_mb must be >= 0, got {self.bucket_mb}.")
        _check_memory_options(self.shard_optimizer)
        # both run the forward program through something the other cannot wrap: refuse
        # the pair rather than silently drop one
        if self.recompute and self.backend != "eager":
            raise ValueError("shardc.compile: block or selective recompute (activation_checkpoint) "
                             f"with backend={self.backend!r} is not supported (the recompute wraps the "
                             "eager program's blocks); use one of them.")
        if self.reshard_after_forward and (self.backend != "eager"
                                           or self.recompute):
            raise ValueError("shardc.compile: reshard_after_forward=True is a pass of the "
                             "whole-step program, which block or selective recompute does not "
                             "run, and has not been tested with backend='inductor'; use one of "
                             "them.")
        if self.prefetch_depth < 0:
            raise ValueError(f"shardc.compile: prefetch_depth must be >= 0, got {self.prefetch_depth}.")


def _as_checkpoint_policy(activation_checkpoint: Any) -> Any:
    """"none", "blocks", or a Selective ("selective" is Selective())."""
    from shardc.passes.recompute import Selective

    if isinstance(activation_checkpoint, Selective):
        return activation_checkpoint
    if activation_checkpoint == "selective":
        return Selective()
    if isinstance(activation_checkpoint, str) and activation_checkpoint in CHECKPOINT_POLICIES:
        return activation_checkpoint
    raise ValueError(
        f"shardc.compile: activation_checkpoint={activation_checkpoint!r} is not one of "
        f"{CHECKPOINT_POLICIES + ('selective',)} or a shardc.Selective(save=[...]) policy.")


def _check_memory_options(shard_optimizer: Any) -> None:
    if not isinstance(shard_optimizer, bool):
        raise TypeError(f"shardc.compile: shard_optimizer must be True or False, got "
                        f"{shard_optimizer!r}.")


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
