"""CPU matmul ceilings: fp32 and bf16 square matmuls at 1 thread and at torch's thread count, side by side.

    python benchmarks/peaks.py [--json] [--quick] [--n 2048]

The CPU figures in docs/benchmarks.md run in fp32 (the precision of the CPU training path and its tests), and
their MFU / fraction-of-peak rows divide by the fp32 rate. Whether bf16 would be faster depends on the host: a
CPU without bf16 matrix units runs it far slower than fp32, one with AMX-bf16 faster. This records which, on the
host that measured the table (`cpu_flags` lists the bf16-related flags /proc/cpuinfo shows). Writes
runs/bench/peaks.json (--quick: runs/bench/quick/peaks.json).
"""
from __future__ import annotations

import argparse

import torch

from k3.benchtools import bench_out, machine, matmul_peak, positive_int, write_result


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            words = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return sorted(w for w in set(words) if "bf16" in w or w.startswith("amx"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="n = 512, 2 repeats")
    ap.add_argument("--n", type=positive_int, default=2048)
    ap.add_argument("--repeats", type=positive_int, default=5)
    args = ap.parse_args(argv)
    n, repeats = (512, 2) if args.quick else (args.n, args.repeats)
    default_threads = torch.get_num_threads()
    out = {"benchmark": "peaks", "n": n, "threads": {}, "cpu_flags": cpu_flags(), "machine": machine()}
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        r = {name: matmul_peak(repeats, n, dt) for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        r["bf16_over_fp32"] = r["bf16"]["median_gflops"] / r["fp32"]["median_gflops"]
        out["threads"][str(threads)] = r
    torch.set_num_threads(default_threads)
    one = out["threads"]["1"]
    out["fp32_gflops_1thread"] = one["fp32"]["median_gflops"]
    out["bf16_gflops_1thread"] = one["bf16"]["median_gflops"]
    out["bf16_over_fp32_1thread"] = one["bf16_over_fp32"]
    path = write_result(bench_out("peaks", args.quick), out, args.json)
    if not args.json:
        for t, r in out["threads"].items():
            print(f"{t} thread(s): fp32 {r['fp32']['median_gflops']:.0f} GFLOP/s, bf16 {r['bf16']['median_gflops']:.0f} "
                  f"GFLOP/s ({r['bf16_over_fp32']:.2f}x); flags {' '.join(out['cpu_flags']) or '(none)'}")
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
