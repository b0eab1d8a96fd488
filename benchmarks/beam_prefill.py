"""Beam search's prompt prefill through the transformers wrapper: each distinct prompt once, its states copied to
the beams (`K3ForCausalLM.share_prefill`, the default), against every beam computing the prompt.

    python benchmarks/beam_prefill.py [--json] [--quick] [--preset mini] [--prompt 1024] [--beams 4]

One prompt, `generate(num_beams=k, max_new_tokens=2)` on random weights (speed does not depend on them), 1 thread;
the two settings run in turn within each repeat (host drift hits both alike), median of the repeats. The first
repeat warms up. Both must return the same sequences. Writes runs/bench/beam_prefill.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from k3.benchtools import bench_out, machine, write_result
from k3.config import get_config
from k3.io.hf import K3ForCausalLM
from k3.model.transformer import K3Model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny model, a short prompt")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = get_config("tiny" if args.quick else args.preset)
    n = 32 if args.quick else args.prompt
    hf = K3ForCausalLM.from_k3(K3Model(config), eos_token_id=None).eval()
    ids = torch.randint(32, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=2, num_beams=args.beams, do_sample=False, num_return_sequences=args.beams)
    times = {"shared": [], "every_beam": []}
    outs = {}
    with torch.no_grad():
        for _ in range(1 + args.repeats):
            for name in times:
                hf.share_prefill = name == "shared"
                t0 = time.perf_counter()
                outs[name] = hf.generate(ids, **kw)
                times[name].append(time.perf_counter() - t0)
    if not torch.equal(outs["shared"], outs["every_beam"]):
        raise SystemExit("beam search with a shared prefill returned other sequences")
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    result = {"benchmark": "beam_prefill", "preset": config.name, "prompt_tokens": n, "beams": args.beams,
              "threads": args.threads, "repeats": args.repeats, "seconds": {k: round(v, 4) for k, v in med.items()},
              "shared_speedup": med["every_beam"] / med["shared"], "machine": machine(threads=args.threads)}
    path = write_result(bench_out("beam_prefill", args.quick), result)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.beams} beams, {n}-token prompt: shared prefill {med['shared']:.2f} s, every beam "
              f"{med['every_beam']:.2f} s ({result['shared_speedup']:.2f}x); wrote {path}")
    return result


if __name__ == "__main__":
    main()
