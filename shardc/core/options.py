"""``shardc.Options``: every option of ``compile`` in one object, validated in one place."""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from shardc.core.compat import RECOMPUTE_COMPILED_FROM, torch_version
from shardc.core.errors import OptionError, OptionTypeError
from shardc.core.ir import Selective
from shardc.core.precision import as_precision

GEMM_MODES = ("auto", "default", "NN", "NT", "TN")
CHECKPOINT_POLICIES = ("none", "blocks")
BACKENDS = ("eager", "inductor")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")  # runtime/pipeline.py runs these
# the model chunks a rank holds under schedule="interleaved" when virtual_stages is unset
DEFAULT_VIRTUAL_STAGES = 2
CONTEXT_LAYOUTS = ("auto", "balanced", "contiguous")
CONTEXT_ATTENTIONS = ("ring", "ulysses")  # how the rank's program runs (shardc/program/backend.py)


# torch DDP's defaults: bucket_cap_mb, and the first bucket when that is left unset
# (dist._DEFAULT_FIRST_BUCKET_BYTES)
DEFAULT_BUCKET_MB = 25.0
FIRST_BUCKET_MB = 1.0


@dataclass(frozen=True)
class Options:
    """Every option of ``shardc.compile``, checked once, here. Pass one to
    ``compile(..., options=Options(...))`` or give the same names as keywords (keywords
    override the fields of ``options``); the README's options table documents each.
    A value of the wrong type raises ``OptionTypeError`` (a ``TypeError``), a wrong value
    or a combination that cannot work ``OptionError`` (a ``ValueError``); both are
    ``ShardcError`` and name the option(s) and the way out.

    ``transpose_alternate`` (default True) lays every other GEMM of a chain out
    transposed (Algorithm 1's layer-by-layer alternation), so that one GEMM's output is
    already laid out as the next one's input and the chain needs no re-distribution.

    ``step_graph`` (default True) runs forward and backward as one traced program whose
    passes move and pack the backward collectives: ``overlap`` schedules them against
    compute (OAR, ORS, early buckets) and returns an output whose last step is a
    collective (a mean squared error averaged over data; a cross-entropy mean is all-reduced
    with its target count before backward, which needs the count, and comes out whole)
    before that collective is waited, as a
    ``shardc.PendingOutput`` that waits on its first read (``loss.backward()`` does not
    read it); ``bucket_mb`` packs the post-backward gradient reductions into buckets that
    close once they hold that many MiB, as DDP's reducer closes its own (0: one per
    gradient); left unset it is DDP's default, 25 MiB buckets after a first one of 1 MiB,
    and a size given closes every bucket, the first too, as DDP's ``bucket_cap_mb`` does.
    ``step_graph=False``
    runs autograd's own backward over the forward program (bitwise the same gradients as
    the step program with ``bucket_mb=0``). ``reshard_after_forward`` frees each gathered
    weight after forward and gathers it again in backward (FSDP2's default): less memory,
    one more all-gather per such weight, counted by the comm report.

    ``activation_checkpoint="blocks"`` recomputes every repeated block in backward (run
    with autograd's backward over the forward program: the step passes do not apply);
    ``"selective"`` (or ``shardc.Selective(save=[...])``) cuts the same blocks but keeps
    the outputs of their GEMMs and attention (or of the ops named) and recomputes the
    rest, as torch's selective activation checkpointing does. With ``backend="inductor"``
    either policy is applied inside the step program instead (``passes/remat.py``: the
    ops of a block it does not save move to the backward part, where inductor fuses them
    into the kernels that read them; a block's output stays saved; an activation a block
    all-gathers is gathered again in backward, as Megatron does, and under "blocks" its
    weights too; other collectives and random draws keep their outputs saved), and the
    step passes apply; "blocks" with ``step_graph=False`` runs each segment compiled
    between its collectives under autograd's checkpoint.
    ``precision="bf16"`` computes and communicates in bf16 with fp32 parameters and
    gradient reductions; a ``shardc.Precision(compute, reduce)`` says both dtypes (see
    ``shardc.core.precision``). ``shard_optimizer=True`` shards the optimizer state
    over data (ZeRO-1/2): ``sm.parameters()`` are then each rank's 1/G_data slices of the
    stored shards (``runtime/zero.py``).
    ``prefetch_depth`` (default 1) issues each weight's all-gather that many GEMMs ahead,
    in forward and in a recompute's replay of a block (a gather stays in its block's
    segment: one issued ahead of a block boundary runs with the next block).

    ``gemm_modes`` ("default", "NN", "NT", "TN", "auto") puts each GEMM of the step
    program in a form (operand layouts); "auto" times the forms on the first batch.

    ``expert_axes=("data",)`` cuts a mixture of experts' stacked expert weights on their
    expert dim over that batch axis (expert parallelism): each rank holds E/G experts,
    and inside a routing region every grouped GEMM sends each token-expert row to its
    expert's rank by all-to-all and the result back (``runtime/experts.py``), dropless.
    ``"data"``, ``"z"`` or both (``("z", "data")``: the first outermost; the rows then
    travel one axis at a time). ``expert_capacity=f``: each rank sends each expert at
    most ``ceil(f * rows / E)`` of its token-expert rows, padded to that many (static
    all-to-alls), and drops the rest (their expert output zero, counted in
    ``sm.expert_load()``); None (default) runs dropless.

    ``microbatches``, ``schedule`` and ``virtual_stages`` (a mesh with ``pipe > 1``;
    docs/pipeline.md): the micro-batches a step's batch is cut into, the order the stages
    run them in ("gpipe", "1f1b", "interleaved", "zero_bubble"), and under "interleaved"
    the model chunks each rank holds (default 2: the model cut into pipe x 2 stages,
    chunk c of pipe rank r being stage c * pipe + r). ``split_points``: where the stages
    begin, by module name (``model.named_modules()``'s), one fewer than the stages, in the
    order forward runs them; None (default) cuts between the repeated blocks, balanced by
    FLOPs.

    ``context_attention`` and ``context_layout`` (a mesh with ``context > 1``;
    docs/long_sequences.md): attention on the cut sequence by a ring (``"ring"``, default:
    keys and values passed rank to rank) or by all-to-alls (``"ulysses"``: from the
    sequence cut to a head cut and back around a local attention; where the heads do not
    divide, that attention takes the ring). Inputs always arrive cut into contiguous blocks
    of the sequence (``shard_batch``); ``"balanced"`` re-cuts them once, at the start, so
    that each rank holds a chunk of each of up to 16 stripes, and a causal ring gives the
    ranks even work; ``"contiguous"`` keeps the blocks; ``"auto"`` (default) is balanced
    with the ring and contiguous with ulysses (whose all-to-all needs plain blocks, and
    whose local attention is balanced anyway).

    ``sequence_parallel`` (default True; a mesh with x or y > 1): a tensor-parallel GEMM's
    partial sum whose every path to the next GEMMs is token-wise (norms, dropout,
    residual adds, activations), with a norm on it, is reduce-scattered onto the tokens,
    those ops run on 1/G of them and the next GEMM all-gathers its input (Megatron's
    sequence parallelism; passes/rules/sequence.py). False keeps Algorithm 1's all-reduce.

    ``backend="inductor"`` compiles each part of the step program (forward, backward) with
    inductor as one graph, its collectives and random draws inside as ops that keep the
    program's order (``shardc.program.backend``); the forward program (no gradients, or
    ``step_graph=False``) is compiled between its collectives.
    """

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
    # the batch axes a mixture of experts' expert dim is cut over (None: experts kept as
    # any other weight); a tuple of axis names
    expert_axes: Any = None
    expert_capacity: Any = None
    # a mesh with pipe > 1: the micro-batches a step's global batch is cut into (None:
    # as many as stages) and the order the stages run them in
    microbatches: Any = None
    schedule: str = "1f1b"
    # schedule="interleaved": the model chunks (virtual stages) each rank holds, so the
    # model is cut into pipe x virtual_stages stages (None: DEFAULT_VIRTUAL_STAGES)
    virtual_stages: Any = None
    # a mesh with pipe > 1: the modules each of which begins a stage, in forward order
    # (None: the stages are cut between the repeated blocks, balanced by FLOPs)
    split_points: Any = None
    # a mesh with context > 1: how the sequence is cut inside the program ("balanced":
    # stripes, so a causal ring gives the ranks even work; "contiguous": the blocks the
    # inputs arrive in; "auto": balanced with the ring, contiguous with ulysses) and how
    # attention runs on it ("ring" or "ulysses")
    context_layout: str = "auto"
    context_attention: str = "ring"
    # a GEMM's partial sum over x or y reduce-scattered onto tokens where the ops up to
    # the next GEMMs work token by token (Megatron's sequence parallelism)
    sequence_parallel: bool = True
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
        """The size at which the first bucket closes: DDP's rule. Left at the default, the
        first bucket closes once it holds 1 MiB, so the last layers' gradients go out while
        backward still has most of the model to do; a size the user gives closes every
        bucket, the first too (as DDP's ``bucket_cap_mb`` does), which saves a collective a
        step where overlap buys nothing: 8 gloo ranks sharing 2 cores (docs/step_time.md)."""
        if self.bucket_mb is None:
            return min(self.bucket_bytes, int(FIRST_BUCKET_MB * 2 ** 20))
        return self.bucket_bytes

    @property
    def recompute(self) -> bool:
        """Does the forward program recompute blocks in backward under autograd's
        checkpoint (the eager backend's policies, and "blocks" with inductor and
        step_graph=False)? Then the step program does not run."""
        return bool(self.activation_checkpoint != "none") and not self.recompute_in_step

    @property
    def recompute_in_step(self) -> bool:
        """Is recompute applied inside the step program (``backend="inductor"``):
        ``passes/remat.py`` moves the ops a block does not save into the backward part? A
        selective policy always; ``"blocks"`` where the step program runs (with
        ``step_graph=False`` its segments run compiled under autograd's checkpoint)."""
        if self.backend != "inductor":
            return False
        if isinstance(self.activation_checkpoint, Selective):
            return True
        return self.activation_checkpoint == "blocks" and self.step_graph

    def __post_init__(self) -> None:
        _check_types(self)
        try:
            object.__setattr__(self, "precision", as_precision(self.precision))
        except TypeError as e:
            raise OptionTypeError(str(e)) from None
        except ValueError as e:
            raise OptionError(str(e)) from None
        object.__setattr__(self, "activation_checkpoint",
                           _as_checkpoint_policy(self.activation_checkpoint))
        if self.backend not in BACKENDS:
            raise OptionError(
                f"shardc.compile: backend={self.backend!r} is not one of {BACKENDS}: 'eager' runs "
                "the rank's program op by op, 'inductor' compiles each part of the step "
                "program with inductor, collectives inside.")
        if self.gemm_modes not in GEMM_MODES:
            raise OptionError(
                f"shardc.compile: gemm_modes={self.gemm_modes!r} is not one of {GEMM_MODES}."
            )
        if self.gemm_modes != "default" and (not self.step_graph or self.recompute):
            # the forms are a pass of the step program: refuse rather than run the
            # traced forms while claiming others
            raise OptionError(
                f"shardc.compile: gemm_modes={self.gemm_modes!r} rewrites the GEMMs of the "
                "step program, which step_graph=False and block or selective recompute "
                "do not run; use gemm_modes='default' with them.")
        if self.reshard_after_forward and not self.step_graph:
            raise OptionError("shardc.compile: reshard_after_forward=True re-gathers weights inside "
                             "the step program; it needs step_graph=True.")
        if self.bucket_mb is not None and self.bucket_mb < 0:
            raise OptionError(f"shardc.compile: bucket_mb must be >= 0, got {self.bucket_mb}.")
        # both run the forward program through something the other cannot wrap: refuse
        # the pair rather than silently drop one
        if self.activation_checkpoint == "blocks" and self.backend != "eager" \
                and not self.recompute_in_step and torch_version() < RECOMPUTE_COMPILED_FROM:
            raise OptionError(
                f"shardc.compile: activation_checkpoint='blocks' with backend={self.backend!r} needs "
                f"torch >= {'.'.join(map(str, RECOMPUTE_COMPILED_FROM))} (this is {torch.__version__}): "
                "on older torch the gradient hooks of parameters read by compiled code inside a "
                "checkpoint did not fire, so their gradients went unreduced. Use one of them.")
        if self.recompute_in_step and not self.step_graph:
            # under inductor the policy is a pass of the step program (remat.py): compiled
            # code runs fused kernels a per-op policy would never see
            raise OptionError("shardc.compile: selective recompute (activation_checkpoint="
                             f"{self.activation_checkpoint!r}) with backend={self.backend!r} is "
                             "applied inside the step program, which step_graph=False does not "
                             "run; use step_graph=True, activation_checkpoint='blocks', or "
                             "backend='eager'.")
        if self.reshard_after_forward and self.recompute:
            raise OptionError("shardc.compile: reshard_after_forward=True is a pass of the "
                             "step program, which block or selective recompute does not "
                             "run; use one of them.")
        if self.prefetch_depth < 0:
            raise OptionError(f"shardc.compile: prefetch_depth must be >= 0, got {self.prefetch_depth}.")
        object.__setattr__(self, "expert_axes", _as_expert_axes(self.expert_axes))
        if self.microbatches is not None and (not isinstance(self.microbatches, int)
                                              or isinstance(self.microbatches, bool)):
            raise OptionTypeError(f"shardc.compile: microbatches={self.microbatches!r} must be an int "
                                  "(or None: as many as pipeline stages).")
        if self.microbatches is not None and self.microbatches < 1:
            raise OptionError(f"shardc.compile: microbatches must be >= 1, got {self.microbatches}.")
        if self.schedule not in SCHEDULES:
            raise OptionError(f"shardc.compile: schedule={self.schedule!r} is not one of {SCHEDULES}.")
        if self.virtual_stages is not None:
            if not isinstance(self.virtual_stages, int) or isinstance(self.virtual_stages, bool):
                raise OptionTypeError(f"shardc.compile: virtual_stages={self.virtual_stages!r} must be "
                                      "an int (or None).")
            if self.virtual_stages < 1:
                raise OptionError(f"shardc.compile: virtual_stages must be >= 1, got {self.virtual_stages}.")
            if self.virtual_stages > 1 and self.schedule != "interleaved":
                raise OptionError(
                    f"shardc.compile: virtual_stages={self.virtual_stages} with schedule="
                    f"{self.schedule!r}: only schedule='interleaved' runs several model chunks a rank.")
        if self.split_points is not None:
            pts = self.split_points
            if isinstance(pts, str) or not isinstance(pts, (tuple, list)) or \
                    not all(isinstance(q, str) and q for q in pts):
                raise OptionTypeError(
                    f"shardc.compile: split_points={pts!r} must be a tuple of module names (as "
                    "model.named_modules() names them), e.g. split_points=('layers.4',).")
            if not pts or len(set(pts)) != len(pts):
                raise OptionError(f"shardc.compile: split_points={pts!r}: name at least one module, "
                                  "each once (each begins a new stage).")
            object.__setattr__(self, "split_points", tuple(pts))
        if self.expert_capacity is not None:
            f = self.expert_capacity
            if isinstance(f, bool) or not isinstance(f, (int, float)):
                raise OptionTypeError(f"shardc.compile: expert_capacity={f!r} must be a number "
                                      "(a capacity factor, e.g. 1.25) or None (dropless).")
            if not math.isfinite(f) or f <= 0:
                raise OptionError(f"shardc.compile: expert_capacity={f!r}: a capacity factor is a "
                                  "finite number > 0 (1.0: each expert takes an even share of a "
                                  "rank's rows); None runs dropless.")
            if self.expert_axes is None:
                raise OptionError(
                    f"shardc.compile: expert_capacity={f!r} without expert_axes: the capacity bounds "
                    "the rows each rank sends each expert when the experts are cut over ranks; "
                    "give expert_axes too (docs/experts.md), or leave expert_capacity=None.")
        if self.context_layout not in CONTEXT_LAYOUTS:
            raise OptionError(f"shardc.compile: context_layout={self.context_layout!r} is not one of "
                              f"{CONTEXT_LAYOUTS} (docs/long_sequences.md).")
        if self.context_attention not in CONTEXT_ATTENTIONS:
            raise OptionError(f"shardc.compile: context_attention={self.context_attention!r} is not one of "
                              f"{CONTEXT_ATTENTIONS} (docs/long_sequences.md).")
        if self.context_attention == "ulysses" and self.context_layout == "balanced":
            # the stripes would reach the heads by gathers, not an all-to-all
            raise OptionError("shardc.compile: context_attention='ulysses' with context_layout='balanced': "
                              "Ulysses's all-to-all moves plain blocks of the sequence, and its local "
                              "attention is balanced anyway. Use context_layout='contiguous' (or 'auto').")

    @property
    def chunks(self) -> int:
        """The model chunks (virtual stages) a pipeline rank holds: 1 but under
        ``schedule="interleaved"``."""
        if self.schedule != "interleaved":
            return 1
        return self.virtual_stages or DEFAULT_VIRTUAL_STAGES

    @property
    def balanced_context(self) -> bool:
        """Does the program re-cut a context-cut sequence into stripes (context_layout)?"""
        if self.context_layout == "auto":
            return self.context_attention == "ring"
        return self.context_layout == "balanced"


# the axes that cut the tokens, over which an all-to-all can move them to their expert
EXPERT_AXES = ("data", "z")


def _as_expert_axes(axes: Any) -> tuple[str, ...] | None:
    """None, or a tuple of batch axis names ("data", "z"), each once."""
    if axes is None:
        return None
    if isinstance(axes, str):
        raise OptionTypeError(
            f"shardc.compile: expert_axes={axes!r} must be a tuple of axis names, "
            f"e.g. expert_axes=({axes!r},).")
    if not isinstance(axes, (tuple, list)) or not all(isinstance(a, str) for a in axes):
        raise OptionTypeError(f"shardc.compile: expert_axes={axes!r} must be a tuple of axis names "
                              f"such as ('data',), or None.")
    axes = tuple(axes)
    bad = [a for a in axes if a not in EXPERT_AXES]
    if bad:
        raise OptionError(
            f"shardc.compile: expert_axes={axes!r}: {bad[0]!r} does not cut the tokens, so no "
            f"all-to-all can bring them to their experts; use one of {EXPERT_AXES}.")
    if not axes or len(set(axes)) != len(axes):
        raise OptionError(f"shardc.compile: expert_axes={axes!r}: name each axis once, e.g. "
                          "('data',) or ('z', 'data').")
    return axes


def _as_checkpoint_policy(activation_checkpoint: Any) -> Any:
    """"none", "blocks", or a Selective ("selective" is Selective())."""

    if isinstance(activation_checkpoint, Selective):
        return activation_checkpoint
    if activation_checkpoint == "selective":
        return Selective()
    if isinstance(activation_checkpoint, str) and activation_checkpoint in CHECKPOINT_POLICIES:
        return activation_checkpoint
    raise OptionError(
        f"shardc.compile: activation_checkpoint={activation_checkpoint!r} is not one of "
        f"{CHECKPOINT_POLICIES + ('selective',)} or a shardc.Selective(save=[...]) policy.")


# the declared type of each field -> the Python types a value may have; a bool is never
# taken for an int (overlap=1 is a mistake, not True)
_TYPES = {"bool": (bool,), "int": (int,), "str": (str,), "float | None": (float, int, type(None))}


def _check_types(options: Options) -> None:
    """Refuse an option of the wrong type before it is used: ``overlap="no"`` is truthy
    and would silently mean True; ``prefetch_depth="2"`` fails deep inside a pass."""
    for f in fields(options):
        want = _TYPES.get(str(f.type))
        value = getattr(options, f.name)
        if want is None:
            continue
        if not isinstance(value, want) or (isinstance(value, bool) and bool not in want):
            kind = ("a bool (True or False)" if want == (bool,)
                    else f"{'an' if str(f.type)[0] in 'aeiou' else 'a'} {f.type}")
            raise OptionTypeError(f"shardc.compile: option {f.name}={value!r} must be {kind}, got "
                                  f"{type(value).__name__}.")


def options_from(options: Options | None, given: dict[str, Any]) -> Options:
    """``compile``'s options: ``options`` (or the defaults) with the keywords ``given``
    over them; a keyword that is no option is refused with the list of those that are."""
    if options is not None and not isinstance(options, Options):
        raise OptionTypeError(f"shardc.compile: options must be a shardc.Options, got "
                              f"{type(options).__name__}.")
    known = {f.name for f in fields(Options)} - INTERNAL
    unknown = sorted(set(given) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise OptionTypeError(f"shardc.compile: no option named {', '.join(map(repr, unknown))}{hint}; "
                              f"the options are {', '.join(sorted(known))}.")
    return replace(options, **given) if options is not None else Options(**given)

# fields that other parts of shardc set (the planner), not compile's keywords
INTERNAL = frozenset({"refuse_indivisible"})
