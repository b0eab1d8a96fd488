"""benchmarks/peers.py (k3 against an HF Llama of equal active parameters, one loop, same data and budget) and
benchmarks/demo_sweep.py (`k3 demo` over a grid), each on its --quick settings: the JSON they write, the Llama's
size, its document masking, and --resume."""
import json
import math

import pytest
import torch


@pytest.fixture(scope="module")
def peers(load_benchmark):
    return load_benchmark("peers")


@pytest.fixture(scope="module")
def quick_data(tmp_path_factory):
    return tmp_path_factory.mktemp("peers") / "data"


def test_doc_positions_restart_at_every_document(peers):
    d = torch.tensor([[3, 3, 3, 4, 4, 5], [7, 7, 7, 7, 7, 7]])
    assert peers.doc_positions(d).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_llama_reads_each_packed_document_on_its_own(peers):
    cfg, n = peers.llama_config(20_000, 64, 16, 2, 2, 64)
    assert abs(n - 20_000) / 20_000 < peers.ACTIVE_TOLERANCE and n == peers.count_llama(cfg)
    torch.manual_seed(0)
    model = peers.LlamaLM(cfg).eval()
    x, d = torch.randint(0, 64, (1, 9)), torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2]])
    packed = model(x, doc_ids=d)
    alone = torch.cat([model(x[:, a:b]) for a, b in ((0, 4), (4, 6), (6, 9))], 1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model(x), alone, atol=1e-3)  # without doc ids: one sequence


def test_quick_run_json_and_resume(peers, quick_data, tmp_path, monkeypatch):
    out = tmp_path / "peers.json"
    args = ["--quick", "--in-process", "--json", "--batch-size", "4", "--data", str(quick_data), "--out", str(out)]
    res = peers.main(args)
    assert json.loads(out.read_text()) == res
    k3, llama = res["models"]["k3"], res["models"]["llama"]
    assert abs(llama["active_params"] - k3["active_params"]) / k3["active_params"] <= llama["tolerance"] == 0.005
    assert llama["params"] == llama["active_params"] and k3["params"] > k3["active_params"]
    assert set(res["runs"]) == {f"{m}-lr{lr:g}-b4-fp32" for m, lrs in peers.QUICK_LRS.items()
                                for lr in map(float, lrs.split(","))}
    for key, r in res["runs"].items():
        assert math.isfinite(r["val_bpb"]) and r["tokens_per_s"] > 0 and r["steps"] == 8, key
        assert r["doc_mask"] and r["batch_size"] == 4 and r["seq_len"] == 32
        assert (out.with_suffix("") / f"{key}.jsonl").is_file()
    assert set(res["best"]) == {"k3", "llama"}
    for m, b in res["best"].items():
        assert b["val_bpb"] == min(r["val_bpb"] for r in res["runs"].values() if r["model"] == m)
    assert res["k3_minus_llama_bpb"] == pytest.approx(res["best"]["k3"]["val_bpb"] - res["best"]["llama"]["val_bpb"],
                                                      abs=1e-4)
    assert res["llama_over_k3_tokens_per_s"] > 0 and out.with_suffix(".png").is_file()
    # both models scored on the same validation tokens: equal at step 0 up to the models' initial guesses
    assert len({r["val_bpb_start"] for r in res["runs"].values() if r["model"] == "k3"}) == 1

    # --resume: nothing left to run; new settings are refused rather than mixed in
    monkeypatch.setattr(peers, "run_one", lambda *a, **k: pytest.fail("a finished run was rerun"))
    again = peers.main([*args, "--resume"])
    assert again["runs"] == res["runs"]
    with pytest.raises(SystemExit, match="other settings"):
        peers.main([*args, "--resume", "--minutes", "0.3"])


def test_quick_run_in_a_subprocess(peers, quick_data, tmp_path):
    res = peers.main(["--quick", "--models", "llama", "--lrs-llama", "2e-3", "--data", str(quick_data),
                      "--out", str(tmp_path / "p.json")])
    (r,) = res["runs"].values()
    assert r["model"] == "llama" and math.isfinite(r["val_bpb"]) and "k3" not in res["best"]


def test_demo_sweep_quick(load_benchmark, quick_data, tmp_path):
    sweep = load_benchmark("demo_sweep")
    res = sweep.main(["--quick", "--lrs", "3e-3", "--batch-sizes", "4", "--threads", "1", "--data", str(quick_data),
                      "--out", str(tmp_path / "s.json")])
    (p,) = res["points"].values()
    # at the rescoring's batch (4) it sees the demo's own validation tokens
    assert p["val_bpb_fixed"] == pytest.approx(p["val_bpb_end"], abs=1e-6)
    assert res["best"]["lr"] == 3e-3 and not (tmp_path / "s" / "lr0.003-b4-fp32" / "checkpoint").exists()
