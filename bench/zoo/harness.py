"""One case of the zoo, run under MPI against the serial model.

``run_case(name, manager)`` builds the case (cases_pnm.py / cases_credit.py) on every rank (same
seed), runs it serially on the full tensor on rank 0 (the result broadcast: the other ranks
would repeat it on the same cores), then on ShardedTensors, and
compares output, input gradient and every parameter gradient (after mpidp.sync_gradients);
it returns the result as a dict (``status``: match, mismatch, refused -- an UnsupportedOp or
ConfigError, with its message -- or crash). tests/zoo/test_zoo.py runs every case of a
group in one job; as a script (run_zoo.py's), one case, each rank writing
<outdir>/<case>_P<n>_r<rank>.json: python -m mpi4py harness.py <case> <outdir>
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from mpidp.errors import ConfigError
from mpidp.sharded import UnsupportedOp

#: the errors that are refusals (an op or set-up mpidp cannot run exactly, refused on every
#: rank), not crashes: a report counts them apart
REFUSALS = (UnsupportedOp, ConfigError)


def tb_tail(n=12):
    return traceback.format_exc().strip().splitlines()[-n:]


def model_frame():
    """The innermost traceback frame in the model package (not mpidp, not torch)."""
    tb = traceback.extract_tb(sys.exc_info()[2])
    keep = [
        f
        for f in tb
        if "site-packages" in f.filename
        and "/torch/" not in f.filename
        and "/mpidp/" not in f.filename
    ]
    if not keep:
        return ""
    f = keep[-1]
    return f"{f.filename.split('site-packages/')[-1]}:{f.lineno} in {f.name}: {f.line}"


def refused(e, stage):
    """The result fields of a refusal ``e`` (one of :data:`REFUSALS`) raised at ``stage``: what
    cannot be done exactly, refused with its message on every rank -- never a wrong number, so
    a report tells it from a crash (a bug)."""
    msg = str(e)
    return {
        "status": "refused",
        "refusal": type(e).__name__,
        "stage": stage,
        "message_first_line": (msg.splitlines() or [""])[0],
        "message": msg[:3000],
        "traceback": tb_tail(6),
        "model_frame": model_frame(),
    }


def tensors_of(y):
    """The tensors of a model output (tensor, tuple/list, dict), in order."""
    if isinstance(y, torch.Tensor):
        return [y]
    if isinstance(y, (list, tuple)):
        return [t for o in y for t in tensors_of(o)]
    if isinstance(y, dict):
        return [t for k in sorted(y) for t in tensors_of(y[k])]
    return []


def relerr(got, want):
    got = got.detach().as_subclass(torch.Tensor).to(torch.float64)
    want = want.detach().as_subclass(torch.Tensor).to(torch.float64)
    if got.shape != want.shape:
        return float("inf"), f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = float(want.abs().max()) if want.numel() else 0.0
    d = float((got - want).abs().max()) if want.numel() else 0.0
    return d / (scale or 1.0), None


def build(case, dtype, blocks=False):
    """The case's model in ``dtype`` and random inputs of its shapes (on ``blocks``, those of
    its ``inputs_blocks`` where it gives them: uneven over 2 x 2 where the model allows, and
    the model of its ``model_blocks``)."""
    torch.manual_seed(0)
    spec = case()  # dict: model, inputs (list of full tensors), shard (index of input), dim, call
    if blocks and "inputs_blocks" in spec:
        spec["inputs"] = spec["inputs_blocks"]
    if blocks and "model_blocks" in spec:
        spec["model"], spec["ctor"] = spec["model_blocks"], spec["ctor_blocks"]
    cast = spec.get("cast", lambda m, dt: m.to(dt))  # a case may say how its model changes dtype
    model = cast(spec["model"], dtype) if dtype != torch.float32 else spec["model"]
    gen = torch.Generator().manual_seed(1)
    ins = [
        (
            torch.randn(t.shape, generator=gen, dtype=torch.float64).to(dtype)
            if t.is_floating_point()
            else t
        )
        if isinstance(t, torch.Tensor)
        else t
        for t in spec["inputs"]
    ]
    return spec, model, ins


def run_serial(spec, model, ins):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # the sharded run starts from the same state: same dropout masks
    x = ins[spec.get("shard", 0)].clone().requires_grad_()
    args = list(ins)
    args[spec.get("shard", 0)] = x
    y = spec.get("call", lambda m, *a: m(*a))(model, *args)
    ys = tensors_of(y)
    ws = [
        torch.randn(
            t.shape, generator=torch.Generator().manual_seed(5 + i), dtype=torch.float64
        ).to(t.dtype)
        for i, t in enumerate(ys)
    ]
    loss = sum((t * w).sum() for t, w in zip(ys, ws, strict=False) if t.is_floating_point())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [t.detach() for t in ys], ws, x.grad.clone(), grads


class SerialFailed(Exception):
    """The serial run failed on rank 0 (raised on every rank: the broadcast carries why)."""


def serial_reference(spec, model, ins):
    """:func:`run_serial` on rank 0, broadcast to every rank (the others would repeat it on the
    same cores). The other ranks' models start the sharded run as built, rank 0's after one
    serial step (its gradients cleared): a model that keeps state from its first forward is
    run sharded from both. (Not on a deep copy: a model whose forward reaches its modules
    through a closure, as PhysicsNeMo's ModAFNO does, runs the original's parameters from a
    copy.)"""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = None
    if comm.Get_rank() == 0:
        try:
            out = ("ok", run_serial(spec, model, ins))
        except Exception:
            out = ("failed", tb_tail(3))
    out = comm.bcast(out)
    if out[0] == "failed":
        raise SerialFailed(out[1])
    return out[1]


def run_case(case_name, m, group=None):
    """The comparison of one case on manager ``m``'s domain group, as a dict."""
    import mpidp
    from mpidp.sharded import ShardedTensor

    t0 = time.time()
    group = group or os.environ.get("ZOO_GROUP", "pnm")
    case = __import__(f"cases_{group}").CASES[case_name]
    result = {"case": case_name, "P": m.domain_world_size, "rank": m.domain_rank, "meta": {}}
    stage = "build"
    try:
        dtype, blocks = torch.float64, m.grid[1] > 1
        spec, model, ins = build(case, dtype, blocks)
        stage = "serial"
        try:
            ser = serial_reference(spec, model, ins)
        except Exception as err:
            result["float64_serial_failed"] = (
                str(err) if isinstance(err, SerialFailed) else tb_tail(3)
            )
            dtype = torch.float32
            spec, model, ins = build(case, dtype, blocks)
            ser = serial_reference(spec, model, ins)
        result["dtype"] = str(dtype).replace("torch.", "")
        sidx, dim = spec.get("shard", 0), spec["dim"]
        result["meta"] = {
            "constructor": spec.get("ctor", ""),
            "input_shapes": [
                list(t.shape) if isinstance(t, torch.Tensor) else repr(t) for t in ins
            ],
            "sharded_input": sidx,
            "dim": dim,
            "note": spec.get("note", ""),
        }
        y_ser, ws, gx_ser, g_ser = ser
        result["serial_seconds"] = round(time.time() - t0, 1)

        if blocks:  # the latitude and the longitude after it
            dim = (dim, dim + 1)
            bs = m.block_spec(ins[sidx].shape, dim)
            result["sizes"] = [list(bs.lat.sizes), list(bs.lon.sizes)]
        else:
            result["sizes"] = list(m.spec(ins[sidx].shape[dim]).sizes)
        stage = "sharded forward"
        model.zero_grad(set_to_none=True)
        torch.manual_seed(2)
        x = mpidp.shard(ins[sidx], dim, m).requires_grad_()
        args = list(ins)
        args[sidx] = x
        y = spec.get("call", lambda mm, *a: mm(*a))(model, *args)
        ys = tensors_of(y)
        result["out_types"] = [type(t).__name__ for t in ys]
        stage = "sharded loss/backward"
        loss = sum((t * w).sum() for t, w in zip(ys, ws, strict=False) if t.is_floating_point())
        loss.backward()
        stage = "sync_gradients"
        mpidp.sync_gradients(model, m)
        stage = "compare"
        errs = {}
        problems = []
        for i, (t, want) in enumerate(zip(ys, y_ser, strict=False)):
            got = t.full_tensor() if isinstance(t, ShardedTensor) else t
            errs[f"out[{i}]"], p = relerr(got, want)
            if p:
                problems.append(f"out[{i}]: {p}")
        gx = x.grad
        if gx is None:
            problems.append("input grad is None")
        else:
            gx = gx.full_tensor() if isinstance(gx, ShardedTensor) else gx
            errs["grad_input"], p = relerr(gx, gx_ser)
            if p:
                problems.append(f"grad_input: {p}")
        got_g = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        missing = sorted(set(g_ser) - set(got_g))
        extra = sorted(set(got_g) - set(g_ser))
        if missing:
            problems.append(f"param grads missing: {missing[:5]} ({len(missing)})")
        if extra:
            problems.append(f"param grads extra: {extra[:5]}")
        # per-tensor relative error, with the scale floored at 1e-6 x the largest parameter
        # gradient; a gradient within 1000 ulps of the largest is zero in exact arithmetic (a
        # bias before a norm) and rounding noise in both runs: it is compared against the
        # scale of the others. The unfloored worst is recorded too.
        gscale = max((float(g.abs().max()) for g in g_ser.values() if g.numel()), default=1.0)
        noise = 1e3 * torch.finfo(dtype).eps * gscale

        def scale(w):
            return gscale if w <= noise else max(w, 1e-6 * gscale, 1e-300)

        pmax, pname, raw = 0.0, "", {}
        for n in g_ser:
            if n in got_g:
                e, p = relerr(got_g[n], g_ser[n])
                if p:
                    problems.append(f"grad {n}: {p}")
                    continue
                d = float((got_g[n].double() - g_ser[n].double()).abs().max())
                w = float(g_ser[n].abs().max())
                raw[n] = (e, d, w)
                e = d / scale(w)
                if e >= pmax:
                    pmax, pname = e, n
        worst_raw = max(raw.items(), key=lambda kv: kv[1][0], default=(None, None))
        result["worst_param_unfloored"] = {
            "name": worst_raw[0],
            "rel": worst_raw[1][0] if worst_raw[1] else None,
            "abs_diff": worst_raw[1][1] if worst_raw[1] else None,
            "max_abs_serial": worst_raw[1][2] if worst_raw[1] else None,
            "largest_param_grad": gscale,
        }
        errs["grad_params_max"] = pmax
        result["worst_params"] = sorted(
            ((n, d / scale(w), d, w) for n, (_, d, w) in raw.items()),
            key=lambda r: -r[1],
        )[:8]
        result["worst_param"] = pname
        result["n_params_with_grad"] = len(g_ser)
        result["errors"] = errs
        tol = 1e-9 if dtype == torch.float64 else 1e-4
        worst = max(errs.values()) if errs else 0.0
        result["max_rel_err"] = worst
        ok = not problems and worst <= tol
        result["status"] = "match" if ok else "mismatch"
        result["problems"] = problems
    except REFUSALS as e:
        result.update(refused(e, stage))
    except Exception as e:
        result.update(
            status="crash",
            stage=stage,
            exc_type=type(e).__name__,
            message_first_line=(str(e).splitlines() or [""])[0][:1000],
            traceback=tb_tail(14),
            model_frame=model_frame(),
        )
    result["seconds"] = round(time.time() - t0, 1)
    return result


def dry_run(case_name, m, group=None):
    """What ``mpidp plan`` (and so ``validate_sharding_constraints``, the same dry run over
    simulated ranks) says of the case at ``m``'s domain size, as a dict: ``ok``, the problems,
    the notes (where it could not look) and the bytes each rank sends."""
    from mpidp.preflight.plan import plan_model

    group = group or os.environ.get("ZOO_GROUP", "pnm")
    spec, model, ins = build(__import__(f"cases_{group}").CASES[case_name], torch.float32)
    x = ins[spec.get("shard", 0)]
    if spec.get("shard", 0) != 0 or "call" in spec:
        return {"ok": None, "why": "the dry run takes the sharded input first and model(*inputs)"}
    priced = plan_model(
        model,
        tuple(x.shape),
        m.domain_world_size,
        partition=m.partition,
        extra_inputs=ins[1:],
        input_dim=spec["dim"] - x.dim(),
    )
    report = priced.report
    return {
        "ok": report.ok,
        "problems": list(report.problems),
        "notes": list(report.notes),
        "send_bytes": [r.send_bytes for r in priced.ranks],
    }


if __name__ == "__main__":
    from mpi4py import MPI

    import mpidp
    from mpidp.runtime.grid import parse_domain

    case_name, outdir = sys.argv[1], sys.argv[2]
    world, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    domain = os.environ.get("ZOO_DOMAIN", str(world))  # run_zoo.py's: "3" bands, "2x2" blocks
    try:
        manager = mpidp.DistributedManager(domain_parallel_size=parse_domain(domain))
        if os.environ.get("ZOO_ALLOW_EMPTY"):
            manager.partition = mpidp.Balanced(allow_empty=True)
        out = run_case(case_name, manager)
    except REFUSALS as e:  # the set-up refused (a grid that does not fit the world)
        out = {"case": case_name, "P": world, "rank": rank, **refused(e, "import")}
    except Exception:
        out = {
            "case": case_name,
            "P": world,
            "rank": rank,
            "status": "crash",
            "stage": "import",
            "traceback": tb_tail(),
        }
    with open(os.path.join(outdir, f"{case_name}_P{domain}_r{rank}.json"), "w") as f:
        json.dump(out, f, indent=1)
