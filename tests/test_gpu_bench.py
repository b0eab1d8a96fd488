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
    assert moe["grouped_bf16_rel_err_vs_fp32_loop"] < 0.02
    assert max(moe["grouped_bf16_grad_rel_err_vs_bf16_loop"].values()) < 0.01


def test_a_section_past_its_limit_is_recorded_as_a_timeout(gpu_bench, tmp_path):
    res = gpu_bench.main(["--device", "cpu", "--quick", "--only", "kda_speed", "--section-timeout", "1",
                          "--out", str(tmp_path / "gpu.json")])
    assert res["kda_speed"]["error"].startswith("timeout")


def test_unknown_section_is_named(gpu_bench):
    with pytest.raises(SystemExit, match="unknown section"):
        gpu_bench.main(["--device", "cpu", "--only", "kda"])
