"""What the planner knows about the hardware: GPUs per node, memory, and bandwidths.

The planner ranks meshes by predicted communication time (AxoNN, SC'24, section V-B).
That prediction needs, for every axis of a mesh, the bandwidth ``beta`` its collectives
will see. Where a group lies inside one node, the paper looks ``beta`` up in a table
measured once per machine, keyed by (product of the sizes of the axes inside it, group
size), with every group of that shape running at once; where a group spans nodes it uses
equation 7, ``beta_inter / min(G_node, inner)``. :class:`Machine` holds exactly those
inputs and implements that lookup in :meth:`Machine.axis_bandwidth`.

Bandwidth convention: bytes per second in one direction, the figure a ring hop can push
while the neighbour pushes the same amount back (the paper's Slingshot NIC is "25 GB/s
bidirectional", i.e. 25 GB/s each way at once). All presets use this convention, so the
intra- and inter-node figures are comparable.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shardc.core.mesh import Mesh

__all__ = ["Machine", "PRESETS"]

GB = 1e9
GiB = float(1 << 30)

_FORMAT = "shardc.machine/1"
# optional scalar fields of the format (absent in files written before they existed)
_STEP_FIELDS = ("inter_node_latency", "gemm_flops", "memory_bandwidth", "op_overhead",
                "bandwidth_overlap", "latency_overlap")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class Machine:
    """A homogeneous cluster as the bandwidth model of equations 1-7 sees it.

    Fields:
      gpus_per_node: ranks (GPUs, GCDs or CPU processes) that share one node.
      memory_bytes: memory one rank may use for parameters, optimizer state and
        activations; the planner drops meshes whose per-rank estimate exceeds it.
      inter_node_bandwidth: the paper's ``beta_inter``: bytes/s between a pair of nodes
        (all NICs of a node together), per direction.
      intra_node_bandwidth: ``(inner, size) -> bytes/s`` seen by one group of ``size``
        ranks with rank stride ``inner``, measured while all such groups of the node run
        the same collective at once (section V-B, case 1). Only shapes that fit in a
        node (``inner * size <= gpus_per_node``) and that communicate (``size >= 2``)
        belong here.
      name: a label for reports.

    The step-time terms (optional; each left at zero is left out of the prediction, as
    the presets leave them: the paper's model is bandwidth alone). ``profile_machine``
    measures all of them:
      intra_node_latency: ``(inner, size) -> seconds`` one collective call costs in a
        group of that shape whatever its size (the alpha of an alpha-beta model: a
        small message's all-reduce, all groups at once), keyed like the bandwidth table.
      inter_node_latency: the same for a group that spans nodes.
      gemm_flops: FLOP/s one rank sustains on GEMMs while every rank of the node
        computes (ranks sharing cores or memory bandwidth see their share).
      memory_bandwidth: bytes/s one rank reads and writes while every rank of the node
        does: what element-wise ops, norms and the optimizer's step are bound by.
      op_overhead: seconds each op of the step costs beyond its arithmetic and bytes
        (dispatch, kernel launch): what a program of many small ops pays.
      bandwidth_overlap, latency_overlap: how much of a collective's bandwidth time and
        of its latency hide behind compute issued while it is in flight (0: they take
        turns, 1: they run side by side), measured as the share of an all-reduce (a large
        one, five small ones) that disappears behind concurrent GEMMs. They differ where
        the collective's bytes need the cores the GEMMs use (gloo on CPU ranks) while
        its waiting does not.
    """

    gpus_per_node: int
    memory_bytes: float
    inter_node_bandwidth: float
    intra_node_bandwidth: dict[tuple[int, int], float] = field(default_factory=dict)
    name: str = "custom"
    intra_node_latency: dict[tuple[int, int], float] = field(default_factory=dict)
    inter_node_latency: float = 0.0
    gemm_flops: float = 0.0
    memory_bandwidth: float = 0.0
    op_overhead: float = 0.0
    bandwidth_overlap: float = 0.0
    latency_overlap: float = 0.0

    def __post_init__(self) -> None:
        # Validate eagerly: a bad table would otherwise surface as a wrong plan, much later.
        where = f"Machine {self.name!r}" if isinstance(self.name, str) else "Machine"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Machine: name must be a non-empty string, got {self.name!r}.")
        if not _is_int(self.gpus_per_node) or self.gpus_per_node < 1:
            raise ValueError(
                f"{where}: gpus_per_node must be a positive integer (ranks per node), "
                f"got {self.gpus_per_node!r}."
            )
        if not _is_number(self.memory_bytes) or not (0 < self.memory_bytes < math.inf):
            raise ValueError(
                f"{where}: memory_bytes must be a positive finite number of bytes per rank, "
                f"got {self.memory_bytes!r}."
            )
        if not _is_number(self.inter_node_bandwidth) or not (
            0 < self.inter_node_bandwidth < math.inf
        ):
            raise ValueError(
                f"{where}: inter_node_bandwidth must be a positive finite number of bytes/s "
                f"per node, got {self.inter_node_bandwidth!r}."
            )
        if not isinstance(self.intra_node_bandwidth, dict):
            raise ValueError(
                f"{where}: intra_node_bandwidth must be a dict {{(inner, size): bytes_per_s}}, "
                f"got {type(self.intra_node_bandwidth).__name__}."
            )
        table: dict[tuple[int, int], float] = {}
        for key, bw in self.intra_node_bandwidth.items():
            if (
                not isinstance(key, tuple)
                or len(key) != 2
                or not all(_is_int(v) for v in key)
            ):
                raise ValueError(
                    f"{where}: intra_node_bandwidth key {key!r} must be a tuple of two "
                    "integers (inner, size)."
                )
            inner, size = key
            if inner < 1 or size < 2:
                raise ValueError(
                    f"{where}: intra_node_bandwidth key {key!r} needs inner >= 1 and "
                    "size >= 2 (a group of one rank never communicates)."
                )
            if inner * size > self.gpus_per_node:
                raise ValueError(
                    f"{where}: intra_node_bandwidth key {key!r} describes groups spanning "
                    f"{inner * size} ranks, more than gpus_per_node={self.gpus_per_node}; "
                    "groups that span nodes use inter_node_bandwidth (equation 7), remove "
                    "the entry or raise gpus_per_node."
                )
            if not _is_number(bw) or not (0 < bw < math.inf):
                raise ValueError(
                    f"{where}: intra_node_bandwidth[{key!r}] must be a positive finite "
                    f"number of bytes/s, got {bw!r}."
                )
            table[(inner, size)] = float(bw)
        self.intra_node_bandwidth = dict(sorted(table.items()))
        self.memory_bytes = float(self.memory_bytes)
        self.inter_node_bandwidth = float(self.inter_node_bandwidth)
        for fld in _STEP_FIELDS:
            v = getattr(self, fld)
            share = fld.endswith("overlap")
            if not _is_number(v) or not (0 <= v < math.inf) or (share and v > 1):
                rng = "in [0, 1]" if share else "a finite number >= 0 (0: not modelled)"
                raise ValueError(f"{where}: {fld} must be {rng}, got {v!r}.")
            setattr(self, fld, float(v))
        if not isinstance(self.intra_node_latency, dict):
            raise ValueError(f"{where}: intra_node_latency must be a dict {{(inner, size): seconds}}, "
                             f"got {type(self.intra_node_latency).__name__}.")
        lat: dict[tuple[int, int], float] = {}
        for key, v in self.intra_node_latency.items():
            if key not in self.intra_node_bandwidth:
                raise ValueError(f"{where}: intra_node_latency has the key {key!r}, which the "
                                 "bandwidth table lacks; both describe the same group shapes.")
            if not _is_number(v) or not (0 <= v < math.inf):
                raise ValueError(f"{where}: intra_node_latency[{key!r}] must be a finite number "
                                 f"of seconds >= 0, got {v!r}.")
            lat[key] = float(v)
        self.intra_node_latency = dict(sorted(lat.items()))

    def models_step(self) -> bool:
        """Whether any step-time term beyond bandwidth is set (the planner then traces each
        pattern's step program to count its collectives, ops and overlaps)."""
        return bool(self.intra_node_latency or self.inter_node_latency or self.gemm_flops
                    or self.memory_bandwidth or self.op_overhead)

    # ------------------------------------------------------------------ the model
    def axis_bandwidth(self, mesh: Mesh, axis: str) -> float:
        """Bytes/s the collectives over ``axis`` of ``mesh`` see (section V-B).

        ``inner`` is the product of the sizes of the axes inside ``axis`` (its rank
        stride). A group that fits in a node (``inner * size <= gpus_per_node``) uses the
        measured table; one that spans nodes uses equation 7,
        ``beta_inter / min(gpus_per_node, inner)``: the ``inner`` rings running side by
        side share the node's links, but a node cannot carry more rings across its
        boundary than it has GPUs. An axis of size 1 never communicates: ``math.inf``.
        """
        size = mesh.size(axis)
        if size == 1:
            return math.inf
        inner = mesh.stride(axis)
        if inner * size <= self.gpus_per_node:
            try:
                return self.intra_node_bandwidth[(inner, size)]
            except KeyError:
                have = ", ".join(f"({i}, {s})" for i, s in self.intra_node_bandwidth) or "none"
                raise ValueError(
                    f"Machine {self.name!r}: no intra-node bandwidth for axis {axis!r} of "
                    f"{mesh.spec()} (groups of {size} ranks at stride {inner}, key "
                    f"({inner}, {size})); the machine has keys {have}. Add the entry "
                    "(measure it with shardc.runtime.profile.profile_machine), or choose a "
                    "mesh whose inner groups divide the node."
                ) from None
        return self.inter_node_bandwidth / min(self.gpus_per_node, inner)

    def axis_latency(self, mesh: Mesh, axis: str) -> float:
        """Seconds one collective call over ``axis`` of ``mesh`` costs beyond its bytes:
        the latency table's entry where the group fits in a node (0 when the machine has
        no table), ``inter_node_latency`` where it spans nodes, 0 for an axis of size 1."""
        size = mesh.size(axis)
        if size == 1:
            return 0.0
        inner = mesh.stride(axis)
        if inner * size > self.gpus_per_node:
            return self.inter_node_latency
        if not self.intra_node_latency:
            return 0.0
        try:
            return self.intra_node_latency[(inner, size)]
        except KeyError:
            raise ValueError(
                f"Machine {self.name!r}: no intra-node latency for axis {axis!r} of "
                f"{mesh.spec()} (key ({inner}, {size})); profile the machine again "
                "(shardc profile-machine) or drop intra_node_latency.") from None

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str) -> Machine:
        """A built-in machine: ``"perlmutter"``, ``"frontier"``, ``"alps"`` or ``"local"``.

        Every figure and its source is documented in :data:`PRESETS`' builders below;
        the intra-node tables are assumptions from vendor link figures, not measurements,
        and should be replaced by :func:`shardc.runtime.profile.profile_machine` output
        on the real machine.
        """
        key = name.strip().lower() if isinstance(name, str) else name
        if key not in PRESETS:
            raise ValueError(
                f"Machine.preset: unknown machine {name!r}; the presets are "
                f"{sorted(PRESETS)}. For another machine build Machine(...) or "
                "Machine.load(path) a profiled JSON file."
            )
        return PRESETS[key]()

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; the table is a list of ``{inner, size, bytes_per_s}``
        because JSON object keys cannot be tuples."""
        return {
            "format": _FORMAT,
            "name": self.name,
            "gpus_per_node": self.gpus_per_node,
            "memory_bytes": self.memory_bytes,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "intra_node_bandwidth": [
                {"inner": i, "size": s, "bytes_per_s": bw}
                for (i, s), bw in self.intra_node_bandwidth.items()
            ],
            "intra_node_latency": [
                {"inner": i, "size": s, "seconds": v}
                for (i, s), v in self.intra_node_latency.items()
            ],
            "inter_node_latency": self.inter_node_latency,
            "gemm_flops": self.gemm_flops,
            "memory_bandwidth": self.memory_bandwidth,
            "op_overhead": self.op_overhead,
            "bandwidth_overlap": self.bandwidth_overlap,
            "latency_overlap": self.latency_overlap,
        }

    def to_json(self) -> str:
        """The machine as JSON text (the format :meth:`load` reads)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to ``path`` so a profile is taken once per machine."""
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_dict(cls, data: object, *, source: str = "<dict>") -> Machine:
        """Build a machine from :meth:`to_dict`'s form; errors name ``source`` and the
        bad field."""

        def bad(fld: str, why: str) -> ValueError:
            return ValueError(
                f"Machine.load: {source}: field {fld!r} {why}. Expected the form written "
                "by Machine.save (see Machine.to_json)."
            )

        if not isinstance(data, dict):
            raise ValueError(
                f"Machine.load: {source}: the top level must be a JSON object, got "
                f"{type(data).__name__}."
            )
        fmt = data.get("format", _FORMAT)
        if fmt != _FORMAT:
            raise bad("format", f"is {fmt!r}, this version reads {_FORMAT!r}")
        known = {"format", "name", "gpus_per_node", "memory_bytes",
                 "inter_node_bandwidth", "intra_node_bandwidth", *_STEP_FIELDS,
                 "intra_node_latency"}
        for k in data:
            if k not in known:
                raise bad(str(k), f"is not a machine field (known: {sorted(known)})")
        for req in ("gpus_per_node", "memory_bytes", "inter_node_bandwidth"):
            if req not in data:
                raise bad(req, "is missing")
        name = data.get("name", "custom")
        if not isinstance(name, str) or not name:
            raise bad("name", f"must be a non-empty string, got {name!r}")
        gpn = data["gpus_per_node"]
        if not _is_int(gpn) or gpn < 1:
            raise bad("gpus_per_node", f"must be a positive integer, got {gpn!r}")
        mem = data["memory_bytes"]
        if not _is_number(mem) or not (0 < mem < math.inf):
            raise bad("memory_bytes", f"must be a positive number of bytes, got {mem!r}")
        inter = data["inter_node_bandwidth"]
        if not _is_number(inter) or not (0 < inter < math.inf):
            raise bad("inter_node_bandwidth",
                      f"must be a positive number of bytes/s, got {inter!r}")
        table: dict[tuple[int, int], float] = {}
        for fld, row in _table_rows(data, "intra_node_bandwidth", "bytes_per_s", bad):
            inner, size, bw = row["inner"], row["size"], row["bytes_per_s"]
            if not _is_int(inner) or not _is_int(size) or inner < 1 or size < 2:
                raise bad(fld, f"needs integers inner >= 1 and size >= 2, got {row!r}")
            if inner * size > gpn:
                raise bad(fld, f"spans {inner * size} ranks, more than gpus_per_node={gpn}")
            if not _is_number(bw) or not (0 < bw < math.inf):
                raise bad(fld, f"needs a positive number bytes_per_s, got {bw!r}")
            if (inner, size) in table:
                raise bad(fld, f"repeats the key (inner={inner}, size={size})")
            table[(inner, size)] = float(bw)
        # the step-time terms are optional: a file written before they existed still loads
        steps: dict[str, float] = {}
        for fld in _STEP_FIELDS:
            v = data.get(fld, 0.0)
            if not _is_number(v) or not (0 <= v < math.inf):
                raise bad(fld, f"must be a finite number >= 0, got {v!r}")
            steps[fld] = float(v)
        latency: dict[tuple[int, int], float] = {}
        for fld, row in _table_rows(data, "intra_node_latency", "seconds", bad):
            if (row["inner"], row["size"]) not in table:
                raise bad(fld, "has no row of the same inner and size in intra_node_bandwidth")
            if not _is_number(row["seconds"]) or not (0 <= row["seconds"] < math.inf):
                raise bad(fld, f"needs a finite number seconds >= 0, got {row!r}")
            latency[(row["inner"], row["size"])] = float(row["seconds"])
        try:
            return cls(gpus_per_node=gpn, memory_bytes=float(mem),
                       inter_node_bandwidth=float(inter), intra_node_bandwidth=table, name=name,
                       intra_node_latency=latency, **steps)
        except ValueError as e:  # overlap above 1: say which file
            raise ValueError(f"Machine.load: {source}: {e}") from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "<string>") -> Machine:
        """Parse :meth:`to_json` output."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"Machine.load: {source} is not valid JSON ({e.msg} at line {e.lineno}, "
                f"column {e.colno}); write it with Machine.save."
            ) from None
        return cls.from_dict(data, source=source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Machine:
        """Read a machine written by :meth:`save` (e.g. a profile of this cluster)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(
                f"Machine.load: cannot read {str(p)!r}: {e.strerror or e}. Pass the path of "
                "a file written by Machine.save, or use Machine.preset(name)."
            ) from None
        return cls.from_json(text, source=repr(str(p)))


def _table_rows(data: dict, name: str, value: str,
                bad: Callable[[str, str], ValueError]) -> list[tuple[str, dict]]:
    """The rows of a JSON table field (a list of {inner, size, <value>}), each with the
    name errors give it; the values are the caller's to check."""
    rows = data.get(name, [])
    if not isinstance(rows, list):
        raise bad(name, f"must be a list of {{\"inner\": int, \"size\": int, \"{value}\": number}}")
    out = []
    for idx, row in enumerate(rows):
        fld = f"{name}[{idx}]"
        if not isinstance(row, dict) or set(row) != {"inner", "size", value}:
            raise bad(fld, f"must be an object with exactly inner, size, {value}; got {row!r}")
        out.append((fld, row))
    return out


# ---------------------------------------------------------------------- presets
# Paper, section VI-B: "Nodes on all systems have four HPE Slingshot 11 NICs, with each
# NIC capable of bidirectional link speeds of 25 GB/s": beta_inter = 4 x 25 GB/s per node.
_SLINGSHOT_NODE = 4 * 25 * GB


def _fully_connected(gpus: int, pair_bw: float) -> dict[tuple[int, int], float]:
    """Intra-node table of a node whose GPUs are all directly linked, ``pair_bw`` bytes/s
    per direction between every pair.

    Assumption: the collective library spreads a group's rings over every direct link
    between its members (NCCL builds several channels), so one rank can push
    ``(size - 1) * pair_bw``; groups of the same shape use disjoint pairs, so running them
    at once costs nothing, and the stride ``inner`` does not matter. Peak link figures,
    not achieved ones: measured busbw is typically 75-85% of this.
    """
    table: dict[tuple[int, int], float] = {}
    for inner in range(1, gpus + 1):
        for size in range(2, gpus // inner + 1):
            if gpus % (inner * size) == 0:
                table[(inner, size)] = (size - 1) * pair_bw
    return table


def _perlmutter() -> Machine:
    """Perlmutter GPU node (paper VI-B): 4 NVIDIA A100, 40 GB each, 4 Slingshot NICs.

    - gpus_per_node = 4, memory_bytes = 40e9 (paper: "DRAM capacity of 40 GB").
    - inter_node_bandwidth = 4 x 25 GB/s = 100 GB/s (paper).
    - intra-node: ASSUMPTION. The four A100-SXM4 are fully connected by third-generation
      NVLink, 12 links of 25 GB/s per direction per GPU, 4 links to each peer: 100 GB/s
      per direction per pair. Table by :func:`_fully_connected`: (1,2) = (2,2) = 100 GB/s,
      (1,4) = 300 GB/s.
    """
    return Machine(gpus_per_node=4, memory_bytes=40 * GB,
                   inter_node_bandwidth=_SLINGSHOT_NODE,
                   intra_node_bandwidth=_fully_connected(4, 100 * GB), name="perlmutter")


def _frontier() -> Machine:
    """Frontier node (paper VI-B): 4 AMD MI250X = 8 GCDs of 64 GB, 4 Slingshot NICs.

    - gpus_per_node = 8 (one rank per GCD), memory_bytes = 64e9 (paper: "each 64 GB GCD").
    - inter_node_bandwidth = 4 x 25 GB/s = 100 GB/s (paper).
    - intra-node: ASSUMPTION from AMD's MI250X figures: the two GCDs of one package
      (ranks 2i, 2i+1) share 4 Infinity Fabric links, 400 GB/s bidirectional, i.e.
      200 GB/s per direction: (1,2) = 200 GB/s. GCDs of different packages are joined by
      one or two xGMI links of 50 GB/s per direction; every other shape ((2,2), (4,2),
      (1,4), (2,4), (1,8)) has ring hops between packages, and with all groups running at
      once we assume each such hop gets one link: 50 GB/s.
    """
    table = {(1, 2): 200 * GB}
    for key in ((2, 2), (4, 2), (1, 4), (2, 4), (1, 8)):
        table[key] = 50 * GB
    return Machine(gpus_per_node=8, memory_bytes=64 * GB,
                   inter_node_bandwidth=_SLINGSHOT_NODE,
                   intra_node_bandwidth=table, name="frontier")


def _alps() -> Machine:
    """Alps GH200 node (paper VI-B): 4 GH200 superchips, H100 with 96 GB each, 4 NICs.

    - gpus_per_node = 4, memory_bytes = 96e9 (paper: "DRAM capacity of 96 GB").
    - inter_node_bandwidth = 4 x 25 GB/s = 100 GB/s (paper).
    - intra-node: ASSUMPTION. Each H100 has 18 fourth-generation NVLinks of 25 GB/s per
      direction (450 GB/s); in the quad-GH200 node they are split 6 per peer, so
      150 GB/s per direction per pair, fully connected: (1,2) = (2,2) = 150 GB/s,
      (1,4) = 450 GB/s.
    """
    return Machine(gpus_per_node=4, memory_bytes=96 * GB,
                   inter_node_bandwidth=_SLINGSHOT_NODE,
                   intra_node_bandwidth=_fully_connected(4, 150 * GB), name="alps")


def _local() -> Machine:
    """This development machine: 8 CPU processes talking gloo over loopback, one node.

    - gpus_per_node = 8 (the 8 gloo ranks the tests and demos spawn).
    - memory_bytes = 24 GiB / 8 = 3 GiB per rank (the box has about 24 GiB of RAM).
    - intra-node: PLACEHOLDER ASSUMPTIONS, 0.25 GB/s for every shape that fits in 8
      ranks: the order of magnitude a quick ``profile_machine(8, 16 MiB, 3)`` measured on
      the 2-core development box (0.18-0.29 GB/s, gloo over loopback, 8 processes on 2
      cores). Replace them with ``profile_machine(8).save(...)`` on your own machine
      before trusting a ranking.
    - inter_node_bandwidth: a single node has no inter-node link; PLACEHOLDER 0.1 GB/s,
      below every intra figure so a mesh that "spans nodes" is never preferred.

    Every (inner, size) with inner * size <= 8 is present (not only divisors of 8) so
    any world size up to 8 can be planned here.
    """
    table = {
        (inner, size): 0.25 * GB
        for inner in range(1, 9)
        for size in range(2, 9)
        if inner * size <= 8
    }
    return Machine(gpus_per_node=8, memory_bytes=24 * GiB / 8,
                   inter_node_bandwidth=0.1 * GB,
                   intra_node_bandwidth=table, name="local")


PRESETS: dict[str, Callable[[], Machine]] = {
    "perlmutter": _perlmutter,
    "frontier": _frontier,
    "alps": _alps,
    "local": _local,
}
"""Preset name -> builder; each builder's docstring gives its sources and assumptions."""
