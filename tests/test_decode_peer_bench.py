"""benchmarks/decode.py's engine-vs-dense part runs and reports its ratios (a smoke test on tiny)."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def _decode_bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode.py"
    spec = importlib.util.spec_from_file_location("decode_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_peer_part_reports_equal_active_params_and_ratios():
    out = _decode_bench().run_peer("tiny", batches=(1, 2), prompt=4, new=2, repeats=1)
    assert abs(out["params"]["llama"] - out["params"]["k3_active"]) <= 0.005 * out["params"]["k3_active"]
    for B in (1, 2):
        r = out["batches"][B]
        assert r["k3_engine_tokens_per_s"] > 0 and r["llama_tokens_per_s"] > 0
        assert out[f"engine_over_dense_decode_b{B}"] == r["engine_over_dense"] > 0
