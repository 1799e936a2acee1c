"""A U-Net training step on one device (scripts/test-gpu.sh): the serial model against its
converted form at world 1 (the same CUDA kernels plus mpidp's wrappers), float32 and bf16
autocast. Prints a table and one JSON line. Not a test.

    python bench/gpu_step.py --device cuda [--grid 721 1440]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    import torch

    import mpidp
    from mpidp.models import WeatherUNet

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--grid", type=int, nargs=2, default=[361, 720])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dev = torch.device(args.device)
    m = mpidp.init(domain_parallel_size=1, device=dev)
    h, w = args.grid
    torch.manual_seed(0)
    serial = WeatherUNet(6, 6, (h, w), width=16).to(dev)
    dist = mpidp.convert_to_domain_parallel(WeatherUNet(6, 6, (h, w), width=16).to(dev), m)
    x, y = torch.randn(1, 6, h, w, device=dev), torch.randn(1, 6, h, w, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step(model: torch.nn.Module, dtype: torch.dtype) -> float:
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = (model(x).float() - y).square().mean()
        loss.backward()
        return float(loss.detach())

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, model in (("torch", serial), ("mpidp", dist)):
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            step(model, dtype)
            times = []
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                step(model, dtype)
                sync()
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else 0.0
            rows.append(
                {
                    "model": name,
                    "dtype": str(dtype),
                    "s": statistics.median(times),
                    "peak_mib": peak,
                }
            )
    print(f"U-Net step, {h} x {w}, 6 channels, width 16, on {dev}: median of {args.steps}")
    for r in rows:
        ms, peak = r["s"] * 1e3, r["peak_mib"]
        print(f"  {r['model']:<6} {r['dtype']:<15} {ms:9.2f} ms  peak {peak:.0f} MiB")
    print(json.dumps({"device": str(dev), "grid": [h, w], "rows": rows}))
    m.shutdown()


if __name__ == "__main__":
    main()
