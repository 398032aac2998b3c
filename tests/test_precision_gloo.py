"""compile(precision=...) on real gloo ranks (4, the module's pool; each case its own
test): the GPT and transformers' Llama trained under the bf16 policy (bf16 compute and
communication, fp32 parameters, fp32 or bf16 gradient reductions) against one device
running the same policy (``shardc.CastAtUse``), on meshes that cover every axis, with the
step program, the forward program (step_graph=False), no_sync accumulation and
reshard-after-forward.

What is compared, and why the tolerances are what they are:

- First-step gradients against a float64 copy of the model (exact to ~1e-16). One
  device under the policy is that far from float64 because of bf16 rounding (8-bit
  mantissa: ~1e-3 of an entry); the compiled program rounds the same products but sums
  them in other orders (shards, rings), which changes the realised error by a small
  factor, as in test_train_gloo: GRAD_FACTOR = 4 of one policy device's max-abs error,
  per parameter. The floor for entries that are zero in exact arithmetic is the same
  reasoning as fp32's, at bf16's unit roundoff (2**-9) of the largest gradient entry:
  there one device may round to exactly 0 while another order leaves a few bf16
  roundings of the cancelling terms. A missing or doubled reduction is off by the
  gradient's own size, hundreds of times this.
- Losses over three AdamW steps against one policy device: each step's loss within 4x
  one policy device's distance to the fp32 model (the size of the policy's own effect on
  the loss), plus one bf16 ulp of the loss (a model returning a bf16 loss rounds it to 8
  bits; another summation order can land one ulp away).
- Measured == reported, exactly, over the second step (after an optimizer step, so that
  shard_optimizer's gather of the stepped slices is in it), and the report's dtypes:
  weights gathered in bf16, gradients reduced in the reduce dtype.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from models import GPT, llama
from test_train_gloo import EPS, GRAD_FACTOR, LR

import shardc

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BF16_UNIT_ROUNDOFF = 2.0 ** -9
BF16_REDUCE = shardc.Precision(torch.bfloat16, torch.bfloat16)
# (model, mesh, policy, compile options): every axis carries a collective in at least one
# case, and each model meets bf16 on tensor and on sharded-data meshes and both reduce
# dtypes (both models on every case: 114 s here; one model a case: 69 s)
CASES = [
    ("llama", "x2y2z1d1", "bf16", {}),
    ("gpt", "x1y1z2d2", "bf16", {}),
    ("llama", "x2y1z2d1", "bf16", {"reshard_after_forward": True}),
    ("gpt", "x1y2z1d2", "bf16", {"step_graph": False}),
    ("llama", "x1y1z2d2", "bf16", {"activation_checkpoint": "blocks"}),
    # every memory option at once: selective recompute, bf16 and the optimizer over data
    ("gpt", "x2y1z1d2", "bf16", {"activation_checkpoint": "selective", "shard_optimizer": True}),
    ("llama", "x1y1z2d2", BF16_REDUCE, {}),
    ("gpt", "x2y1z1d2", BF16_REDUCE, {"step_graph": False}),
    # bf16 through inductor: its casts and bf16 collectives inside the one compiled graph
    ("llama", "x2y1z2d1", "bf16", {"backend": "inductor"}),
    # ... and a data mesh, whose gradient buckets inductor reduces in place
    ("gpt", "x1y1z1d4", "bf16", {"backend": "inductor"}),
    # experts cut over data: bf16 rows travel to them and back
    ("mixtral", "x1y1z2d2", "bf16", {"expert_axes": ("data",)}),
    # ... and transformers' batched_mm experts, sorted at the trace, cut over z, with the
    # bf16 gradient reductions
    ("mixtral-batched", "x1y1z2d2", BF16_REDUCE, {"expert_axes": ("z",)}),
    # the sequence cut over context: a ring attention on bf16 keys and values, its
    # arithmetic in fp32 (runtime/ring.py), with data, and with x under block recompute
    ("llama", "x1y1c2z1d2", "bf16", {}),
    ("gpt", "x2y1c2z1d1", "bf16", {"activation_checkpoint": "blocks"}),
    # pipeline stages: each stage's program casts the weights it reads, bf16 activations
    # and their gradients travel between stages; with data and the optimizer over it, with
    # x under GPipe and block recompute, with z under zero bubble and bf16 reductions
    ("gpt", "p2x1y1z1d2", "bf16", {"microbatches": 2, "shard_optimizer": True}),
    ("llama", "p2x2y1z1d1", "bf16", {"schedule": "gpipe", "microbatches": 4, "activation_checkpoint": "blocks"}),
    ("gpt", "p2x1y1z2d1", BF16_REDUCE, {"schedule": "zero_bubble"}),
]


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
            for _ in range(n)]


def _grad_failures(where: str, grads: dict, one: dict, f64: dict) -> list[str]:
    out = []
    big = max(g.abs().max().item() for g in f64.values())
    floor = BF16_UNIT_ROUNDOFF * big
    for k, g64 in f64.items():
        if grads.get(k) is None or grads[k].dtype != torch.float32:
            out.append(f"{where}: grad {k} is {grads.get(k)!r:.40}, not an fp32 tensor")
            continue
        err = (grads[k].double() - g64).abs().max().item()
        err1 = (one[k].double() - g64).abs().max().item()
        limit = GRAD_FACTOR * err1 + floor
        if not err <= limit:
            out.append(f"{where}: grad {k}: max-abs err vs float64 compiled {err:.3e}, one "
                       f"bf16-policy device {err1:.3e} (limit {limit:.3e})")
    return out


def _train_failures(name: str, make, spec: str, policy, opts: dict) -> list[str]:
    where = f"{name}@{spec} {policy} {opts}"
    mesh = shardc.Mesh.parse(spec)
    batches = _batches(3)
    torch.manual_seed(0)
    model = make()
    ref32, ref64, ref16 = copy.deepcopy(model), copy.deepcopy(model).double(), copy.deepcopy(model)
    one = shardc.CastAtUse(ref16, torch.bfloat16)
    sm = shardc.compile(model, mesh, example_inputs=batches[0], precision=policy, **opts)
    opts32 = torch.optim.AdamW(ref32.parameters(), lr=LR, eps=EPS)
    opt16 = torch.optim.AdamW(ref16.parameters(), lr=LR, eps=EPS)
    opt = torch.optim.AdamW(sm.parameters(), lr=LR, eps=EPS)
    out: list[str] = []
    for step, (tok, tgt) in enumerate(batches):
        if step == 0:
            ref64(tok, tgt).backward()
        l32, l16 = ref32(tok, tgt), one(tok, tgt)
        l32.backward()
        l16.backward()
        sm.reset_measured_comm()
        loss = sm(shardc.shard_batch(tok, mesh), shardc.shard_batch(tgt, mesh))
        loss.backward()
        if step == 1:  # a step after an optimizer step (shard_optimizer gathers then)
            measured, reported = sm.measured_comm(), shardc.comm_report(sm).by_key()
            if measured != reported:
                out.append(f"{where}: measured {measured} != reported {reported}")
        if step == 0:
            out += _grad_failures(where, sm.full_grads(),
                                  {n: p.grad for n, p in ref16.named_parameters()},
                                  {n: p.grad for n, p in ref64.named_parameters()})
        got = shardc.global_mean(loss, mesh).item()
        limit = 4 * abs(l16.item() - l32.item()) + 2.0 ** -8 * abs(l16.item())
        if not abs(got - l16.item()) <= limit:
            out.append(f"{where}: step {step} loss {got} vs one bf16-policy device {l16.item()} "
                       f"(fp32 {l32.item()}, limit {limit:.3e})")
        for o in (opts32, opt16, opt):
            o.step()
            o.zero_grad()
    # the parameters (and so AdamW's state) stay fp32: the policy's master copy
    if {p.dtype for p in sm.parameters()} != {torch.float32}:
        out.append(f"{where}: parameters are {({p.dtype for p in sm.parameters()})}, not fp32")
    return out


def _report_failures(spec: str) -> list[str]:
    """The comm report under the policy against fp32's, collective by collective: weight
    gathers halve, gradient reductions keep the reduce dtype's size."""
    where = f"report@{spec}"
    mesh = shardc.Mesh.parse(spec)
    batch = _batches(1)[0]
    torch.manual_seed(0)
    model = GPT()
    keyed = {}
    for policy in ("fp32", "bf16", BF16_REDUCE):
        keyed[str(policy)] = shardc.comm_report(
            shardc.compile(model, mesh, example_inputs=batch, precision=policy)).by_key()
    f32, b16, r16 = keyed.values()
    out = []
    for key, v in f32.items():
        collective, axis, phase = key
        weights_or_grads = (collective in ("all_gather", "reduce_scatter") and axis == "z"
                            or phase == "step")
        if not weights_or_grads:
            continue
        want_b = v / 2 if collective == "all_gather" else v
        want_r = v / 2
        if b16.get(key) != want_b or r16.get(key) != want_r:
            out.append(f"{where}: {key}: fp32 {v}, bf16 {b16.get(key)} (want {want_b}), "
                       f"bf16 reductions {r16.get(key)} (want {want_r})")
    if not any(k[1] == "z" for k in f32):
        out.append(f"{where}: the mesh gathers nothing over z; the check proves nothing")
    return out


def _pipe_report_failures(spec: str) -> list[str]:
    """Stages under the policy against fp32, send by send on this rank: a floating value
    crossing a stage boundary (an activation forward, its gradient backward) travels in
    bf16, half the bytes; a mask or the labels as they are; no weight crosses."""
    where = f"report@{spec}"
    mesh = shardc.Mesh.parse(spec)
    batch = _batches(1)[0]
    torch.manual_seed(0)
    model = llama()
    sms = {str(p): shardc.compile(model, mesh, example_inputs=batch, precision=p) for p in ("fp32", "bf16")}
    rows = {k: {(r.op, r.phase): r.bytes for r in shardc.comm_report(sm).rows if r.axis == "pipe"}
            for k, sm in sms.items()}
    out = [] if rows["fp32"].keys() == rows["bf16"].keys() else [f"{where}: sends {rows}"]
    st = sms["bf16"].stage
    halved = 0
    for (op, phase), f32 in rows["fp32"].items():
        if op.startswith("output "):
            val = st.output_vals[int(op.split()[1])]
        elif op.startswith("gradient of input "):
            val = st.input_vals[int(op.split()[3])]
        elif op.startswith("the loss"):
            val = st.output_vals[-1]  # the policy's loss, as one device returns it
        else:
            out.append(f"{where}: {op} {phase}: a send that is no boundary value")
            continue
        want = f32 // 2 if val.dtype == torch.bfloat16 else f32
        halved += val.dtype == torch.bfloat16
        if rows["bf16"].get((op, phase)) != want:
            out.append(f"{where}: {op} {phase}: fp32 {f32}, bf16 {rows['bf16'].get((op, phase))} (want {want})")
    if not halved:
        out.append(f"{where}: no bf16 value crossed a stage boundary: {rows}")
    return out


def _case_id(name: str, spec: str, policy, opts: dict) -> str:
    reduce = "bf16" if policy == "bf16" else "bf16-reduce"
    return "-".join([name, spec, reduce] + [f"{k}.{v}" for k, v in opts.items()])


def _case(rank: int, world_size: int, index: int) -> None:
    """CASES[index], or the report's dtypes (index None)."""
    import test_experts_gloo as E
    import transformers.integrations.moe as moe

    # the float64 reference of a grouped_mm MoE: transformers' own kernel (test_experts_gloo)
    moe._can_use_grouped_mm = lambda *args, **kwargs: False
    makers = {"gpt": GPT, "llama": llama, "mixtral": E.MOES["mixtral"], "mixtral-batched": E.MOES["mixtral-batched"]}
    if index is None:
        failures = _report_failures("x1y1z2d2") + _pipe_report_failures("p2x1y1z1d2")
    else:
        name, spec, policy, opts = CASES[index]
        failures = _train_failures(name, makers[name], spec, policy, opts)
    if failures:
        raise AssertionError(f"{len(failures)} failures:\n" + "\n".join(failures))


@pytest.mark.parametrize("index", [pytest.param(i, id=_case_id(*c)) for i, c in enumerate(CASES)]
                         + [pytest.param(None, id="report-x1y1z2d2-p2x1y1z1d2")])
def test_bf16_policy_trains_like_one_device_on_4_ranks(ranks, index: int | None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ranks.run(_case, 4, index)
