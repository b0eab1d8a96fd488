"""k3 plan --stream-experts: the disk tier's memory split, hit rate and time per token."""
import json

import pytest

from k3.config import get_config
from k3.plan.stream import stream_plan


def test_stream_plan_splits_ram_and_adds_the_disk():
    cfg = get_config("tiny", qat={"expert_weights": "mxfp4"})
    size = stream_plan(cfg, ram_gb=1, disk_gbps=1.0, dense_precision="fp32", overhead_gb=0.0)
    ram = size["trunk_gb"] + size["workspace_gb"] + size["experts_on_disk_gb"] / 3  # a third of the experts cached
    r = stream_plan(cfg, ram_gb=ram, disk_gbps=1.0, mem_gbps=10.0, expert_gbps=0.5, dense_precision="fp32",
                    lookahead=1.0, overhead_gb=0.0)
    assert r["fits"] and r["hit_rate"] == pytest.approx(1 / 3)
    assert r["ram_used_gb"] == pytest.approx(ram)
    assert r["bytes_read_per_token"] == pytest.approx((1 - r["hit_rate"]) * r["active_bytes_per_token"])
    assert r["s_per_token_no_prefetch"] == pytest.approx(r["trunk_s"] + r["experts_s"] + r["disk_s"])
    # a perfect lookahead hides the disk behind the compute
    assert r["s_per_token_prefetch"] == pytest.approx(max(r["trunk_s"] + r["experts_s"], r["disk_s"]))
    # half guessed: half the reads wait, and the one disk bounds the whole; never slower than no prefetch
    for disk in (1.0, 0.001):  # compute-bound, disk-bound
        h = stream_plan(cfg, ram_gb=ram, disk_gbps=disk, mem_gbps=10.0, expert_gbps=0.5, dense_precision="fp32",
                        lookahead=0.5, overhead_gb=0.0)
        compute = h["trunk_s"] + h["experts_s"]
        assert h["s_per_token_prefetch"] == pytest.approx(max(compute + h["disk_s"] / 2, h["disk_s"]))
        assert h["s_per_token_prefetch"] <= h["s_per_token_no_prefetch"]
    more = stream_plan(cfg, ram_gb=ram * 1.2, disk_gbps=1.0, dense_precision="fp32", overhead_gb=0.0)
    assert more["hit_rate"] > r["hit_rate"]


def test_full_k3_on_a_64gb_machine_needs_an_fp8_trunk():
    k3 = get_config("k3")
    bf16 = stream_plan(k3, ram_gb=64, disk_gbps=6.0)
    assert not bf16["fits"] and "fp8" in bf16["advice"] and bf16["trunk_gb"] > 100
    fp8 = stream_plan(k3, ram_gb=64, disk_gbps=6.0, dense_precision="fp8")
    assert fp8["fits"] and fp8["bytes_read_per_token"] > 20e9  # 16 x 92 experts of 17.5 MB, nearly all missed


def test_cli(capsys):
    from k3.cli import main

    assert main(["plan", "--preset", "tiny", "--stream-experts", "--ram", "1", "--disk-gbps", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["fits"] and r["tokens_per_s_prefetch"] > 0
    assert main(["plan", "--preset", "tiny", "--stream-experts", "--ram", "1"]) != 0
    assert "--disk-gbps" in capsys.readouterr().err
