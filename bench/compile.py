"""torch.compile (CPU inductor) of a converted U-Net (91 x 180, width 8), against eager, on
one band per rank: graph breaks (torch._dynamo.explain), the first compiled step, agreement
with eager, and step times. Not a test.

    mpiexec -n 1 python -m mpi4py bench/compile.py      # and -n 2
"""

import copy
import statistics
import time

import torch
import torch._dynamo as dynamo
from mpi4py import MPI

import mpidp
from mpidp.models import WeatherUNet

torch.set_num_threads(1)
w = MPI.COMM_WORLD
me, p = w.Get_rank(), w.Get_size()
m = mpidp.init(domain_parallel_size=p)
torch.manual_seed(0)
h, wd = 91, 180
serial = WeatherUNet(4, 4, (h, wd), width=8)
dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
spec = m.spec(h)
x = torch.randn(2, 4, h, wd).narrow(2, spec.start(me), spec[me]).contiguous()
ex = dynamo.explain(dist)(x)
if me == 0:
    print("graphs", ex.graph_count, "breaks", ex.graph_break_count)
    seen = {}
    for b in ex.break_reasons:
        r = str(b.reason).splitlines()[0][:150]
        seen[r] = seen.get(r, 0) + 1
    for r, c in sorted(seen.items(), key=lambda kv: -kv[1])[:8]:
        print(c, r)
dynamo.reset()
comp = torch.compile(dist)


def step(model):
    xg = x.clone().requires_grad_()
    y = model(xg)
    y.square().mean().backward()
    return y.detach(), xg.grad


t0 = time.perf_counter()
yc, gc = step(comp)
t_first = time.perf_counter() - t0
ye, ge = step(dist)
err = max(float((yc - ye).abs().max()), float((gc - ge).abs().max()))
errs = w.allgather(err)


def timeit(model, k=5):
    ts = []
    for _ in range(k):
        w.Barrier()
        t = time.perf_counter()
        step(model)
        ts.append(time.perf_counter() - t)
    return w.allreduce(statistics.median(ts), op=MPI.MAX)


te, tc = timeit(dist), timeit(comp)
te2, tc2 = timeit(dist), timeit(comp)
if me == 0:
    print(
        f"P={p} first compiled step {t_first:.1f} s; max |compiled - eager| {max(errs):.2e}; "
        f"eager {te * 1e3:.1f}/{te2 * 1e3:.1f} ms, compiled {tc * 1e3:.1f}/{tc2 * 1e3:.1f} ms"
    )
m.shutdown()
