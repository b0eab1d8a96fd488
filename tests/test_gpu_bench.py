"""benchmarks/gpu.py runs its sections in child processes under a time limit; a dry run on the CPU checks the
script's own logic (the CUDA-only parts are skipped there), and a too-short limit is reported, not hung on."""
import json

import pytest


@pytest.fixture(scope="module")
def gpu_bench(load_benchmark):
    return load_benchmark("gpu")


def test_dry_run_on_cpu_checks_kda_and_moe(gpu_bench, tmp_path):
    out = tmp_path / "gpu.json"
    res = gpu_bench.main(["--device", "cpu", "--quick", "--only", "kda_check,moe_check", "--out", str(out)])
    assert json.loads(out.read_text())["kda_check"] == res["kda_check"]
    kda = res["kda_check"]["k3_torch_chunk"]
    assert kda["o_rel_err"] < 1e-5 and kda["state_rel_err"] < 1e-5 and max(kda["grad_rel_err"].values()) < 1e-5
    moe = res["moe_check"]
    assert "error" not in moe, moe
    # bf16's own error on the routed path (about 4 % here: K3's latent norm brings the routed path, tiny at init, up
    # to the size of the rest, so its rounding shows); the grouped kernel must add nothing to the loop's
    assert moe["grouped_bf16_rel_err_vs_fp32_loop"] < 0.1
    assert moe["grouped_bf16_rel_err_vs_fp32_loop"] <= 1.1 * moe["loop_bf16_rel_err_vs_fp32_loop"]
    assert max(moe["grouped_bf16_grad_rel_err_vs_bf16_loop"].values()) < 0.01


def test_dry_run_of_the_training_section(gpu_bench, tmp_path):
    res = gpu_bench.main(["--device", "cpu", "--quick", "--only", "train_step", "--out", str(tmp_path / "gpu.json")])
    tr = res["train_step"]
    assert "error" not in tr, tr
    assert tr["all_finite"] and len(tr["losses"]) == 3 and tr["tokens_per_s"] > 0 and tr["fla_autotune"] == "pinned"


def test_pinning_leaves_every_fla_autotuner_one_config():
    """--fla-autotune pinned: after pin_fla_autotune every fla autotuner holds one of its own configs (run in a
    child process: it changes fla's module state)."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import gc, json, sys
sys.path.insert(0, sys.argv[1])
import gpu
from triton.runtime.autotuner import Autotuner
import fla.ops.kda, fla.ops.kda.chunk_bwd
tuners = [a for a in gc.get_objects() if isinstance(a, Autotuner)
          and getattr(a.fn, "fn", a.fn).__module__.startswith("fla.")]
before = {id(a): list(a.configs) for a in tuners}
info = gpu.pin_fla_autotune()
print(json.dumps({"info": info, "n": len(tuners), "multi": sum(len(v) > 1 for v in before.values()),
                  "one_each": all(len(a.configs) == 1 for a in tuners),
                  "own": all(a.configs[0] in before[id(a)] for a in tuners),
                  "n_before": sum(len(v) for v in before.values())}))
"""
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    r = subprocess.run([sys.executable, "-c", code, str(bench)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["n"] > 50 and got["multi"] > 50  # fla 0.6.0 has about 200 autotuned kernels
    assert got["one_each"] and got["own"]
    assert got["info"] == {"autotuners": got["n"], "configs_before": got["n_before"]}


def test_a_section_past_its_limit_is_recorded_as_a_timeout(gpu_bench, tmp_path):
    res = gpu_bench.main(["--device", "cpu", "--quick", "--only", "kda_speed", "--section-timeout", "1",
                          "--out", str(tmp_path / "gpu.json")])
    assert res["kda_speed"]["error"].startswith("timeout")


def test_unknown_section_is_named(gpu_bench):
    with pytest.raises(SystemExit, match="unknown section"):
        gpu_bench.main(["--device", "cpu", "--only", "kda"])


# a stand-in for gpu.py whose `peaks` section saves one row and then hangs: for the cut-off paths below
_HANGING = """
import sys, time
sys.path.insert(0, {bench!r})
import gpu

def hangs(dev, quick):
    out = {{"first_row": 1}}
    gpu.save_partial(out)
    open({marker!r}, "w").close()  # the row is saved: a test may stop the run now
    time.sleep(120)
    return out

gpu.SECTIONS["peaks"] = hangs
gpu.CHILD_SCRIPT = __file__  # the section's child runs this stand-in too
gpu.main()
"""


def _hanging_script(tmp_path) -> str:
    from pathlib import Path

    script = tmp_path / "hanging_gpu.py"
    script.write_text(_HANGING.format(bench=str(Path(__file__).resolve().parents[1] / "benchmarks"),
                                      marker=str(tmp_path / "peaks-saved")))
    return str(script)


def test_a_timed_out_section_keeps_the_rows_it_finished(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, _hanging_script(tmp_path), "--device", "cpu", "--quick", "--only", "peaks",
                        "--section-timeout", "20", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    peaks = json.loads(out.read_text())["peaks"]
    assert peaks["first_row"] == 1 and peaks["partial"] and peaks["error"].startswith("timeout")


def test_a_terminated_run_keeps_the_finished_sections(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "gpu.json"
    p = subprocess.Popen([sys.executable, _hanging_script(tmp_path), "--device", "cpu", "--quick", "--only",
                          "mx,peaks", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while not (tmp_path / "peaks-saved").exists() and time.time() - t0 < 100 and p.poll() is None:
        time.sleep(0.2)  # mx has finished and peaks has saved its first row
    p.send_signal(signal.SIGTERM)
    log = p.communicate(timeout=60)[0]
    assert p.returncode == 128 + signal.SIGTERM, log[-2000:]
    res = json.loads(out.read_text())
    assert "error" not in res["mx"] and res["mx"]["mxfp4"]["random_code_mismatches"] == 0
    assert res["terminated"].startswith(f"signal {int(signal.SIGTERM)}")
    assert res["peaks"]["error"] == "terminated while running" and res["peaks"]["first_row"] == 1


def test_a_run_terminated_between_sections_names_those_it_did_not_run(gpu_bench, tmp_path):
    """A SIGTERM that lands after one section and before the next has started leaves no section unnamed."""
    import signal

    out = tmp_path / "gpu.json"
    real = gpu_bench.run_isolated

    def stop_before_the_second(name, args, timeout):
        if name == "peaks":
            signal.raise_signal(signal.SIGTERM)
        return real(name, args, timeout)

    gpu_bench.run_isolated = stop_before_the_second
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as e:
            gpu_bench.main(["--device", "cpu", "--quick", "--only", "mx,peaks", "--out", str(out)])
    finally:
        gpu_bench.run_isolated = real
        signal.signal(signal.SIGTERM, previous)
    assert e.value.code == 128 + signal.SIGTERM
    res = json.loads(out.read_text())
    assert "error" not in res["mx"] and res["peaks"]["error"] == "not run: terminated"


def test_the_budget_skips_what_it_cannot_fit(gpu_bench, tmp_path):
    res = gpu_bench.main(["--device", "cpu", "--quick", "--only", "peaks,mx", "--budget", "10",
                          "--out", str(tmp_path / "gpu.json")])
    assert res["peaks"]["error"].startswith("skipped") and res["mx"]["error"].startswith("skipped")


def test_a_failing_check_inside_a_section_does_not_hide_the_others(gpu_bench, tmp_path):
    part = tmp_path / "part.json"
    gpu_bench._PARTIAL = (str(part), "s")
    try:
        out = {}
        gpu_bench.guarded(out, "bad", lambda: 1 / 0)
        gpu_bench.guarded(out, "good", lambda: 2)
    finally:
        gpu_bench._PARTIAL = None
    assert out["bad"]["error"].startswith("ZeroDivisionError") and out["good"] == 2
    assert gpu_bench.read_part(str(part), "s")["good"] == 2 and gpu_bench.read_part(str(part), "s")["partial"]


def test_a_section_that_raises_keeps_the_rows_it_saved(gpu_bench, tmp_path):
    """A section that saved rows and then raised (an OOM in its last part, say) keeps those rows beside the
    error; the error used to replace them."""
    part = tmp_path / "part.json"

    def section_fn(dev, quick):
        out = {"mini_layer": {"speedup_vs_loop": 3.5}}
        gpu_bench.save_partial(out)
        raise RuntimeError("out of memory in the last part")
    gpu_bench._PARTIAL = (str(part), "moe_speed")
    try:
        results = {}
        gpu_bench.section(results, "moe_speed", section_fn, gpu_bench.torch.device("cpu"), True)
    finally:
        gpu_bench._PARTIAL = None
    r = results["moe_speed"]
    assert r["mini_layer"]["speedup_vs_loop"] == 3.5 and "out of memory" in r["error"] and "partial" not in r
