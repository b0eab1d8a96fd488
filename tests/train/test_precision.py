"""--precision: bf16 autocast stays within bf16's tolerance of fp32 op by op, its fp32 islands stay fp32, `auto`
follows the (faked) probe and its cache, every command takes the flag, and weights and optimizer state stay fp32."""
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from k3.config import get_config
from k3.train import precision as prec
from k3.train.trainer import TrainConfig, Trainer

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


@pytest.fixture(autouse=True)
def _quiet_rms_norm():
    # torch warns that a bf16 input with an fp32 weight takes rms_norm's unfused (fp32-statistics) path
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def both(fn):
    """fn() in fp32 and under CPU bf16 autocast."""
    ref = fn()
    with torch.autocast(**BF16):
        low = fn()
    return ref, low


# a few bf16 roundings (eps 2^-8) through a handful of matmuls: a relative error of a few percent
TOL = 3e-2


# ---------------------------------------------------------------------- numerics per op
@pytest.fixture
def cfg():
    return get_config("tiny")


def test_kda_layer_under_autocast(cfg):
    from k3.model.kda import KimiDeltaAttention

    layer = KimiDeltaAttention(cfg)
    x = torch.randn(2, 24, cfg.d_model)
    ref, low = both(lambda: layer(x))
    assert rel_err(low, ref) < TOL


def test_kda_recurrence_stays_fp32(cfg):
    """The state recurrence runs with autocast off: its state is fp32, whatever the inputs' dtype."""
    from k3.ops.kda import kda

    B, T, H, K = 1, 20, 2, 8
    q, k, v = (torch.randn(B, T, H, K) for _ in range(3))
    k = F.normalize(k, dim=-1)
    g, beta = -torch.rand(B, T, H, K) * 0.5, torch.rand(B, T, H)
    for impl in ("chunk", "recurrent", "naive"):
        (o32, s32), (o16, s16) = both(lambda: kda(q, k, v, g, beta, output_final_state=True, impl=impl))
        assert s16.dtype == torch.float32 and o16.dtype == torch.float32, impl
        assert torch.equal(s16, s32), impl  # fp32 inputs under autocast: bit-for-bit the fp32 recurrence


def test_mla_layer_under_autocast(cfg):
    from k3.model.mla import GatedMLA

    layer = GatedMLA(cfg, layer_idx=cfg.n_layers - 1)
    x = torch.randn(2, 24, cfg.d_model)
    ref, low = both(lambda: layer(x))
    assert rel_err(low, ref) < TOL
    # the absorbed (decode) form's softmax is fp32 even for bf16 scores
    ref, low = both(lambda: layer(x, absorb=True))
    assert rel_err(low, ref) < TOL


def test_moe_layer_and_router_under_autocast(cfg):
    from k3.model.moe import MoE

    layer = MoE(cfg)
    x = torch.randn(2, 24, cfg.d_model)
    ref, low = both(lambda: layer(x))
    assert rel_err(low, ref) < TOL
    # router scores, top-k and weights in fp32 under autocast: the same experts, the same weights
    (w32, e32), (w16, e16) = both(lambda: layer.router(x))
    assert w16.dtype == torch.float32 and torch.equal(e16, e32) and torch.allclose(w16, w32, rtol=1e-6, atol=1e-7)
    # bf16 input (another layer's autocast output): the scores are still fp32
    with torch.autocast(**BF16):
        w, _ = layer.router(x.bfloat16())
    assert w.dtype == torch.float32


def test_rmsnorm_under_autocast(cfg):
    """Statistics in fp32 (torch's rms_norm for a bf16 input): the result is fp32's, rounded once to bf16."""
    norm = torch.nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(4, 16, cfg.d_model) * 30 + 5).bfloat16()  # large values: bf16 statistics would drift
    ref = norm(x.float())
    with torch.autocast(**BF16):
        low = norm(x)
    assert (low.float() - ref).abs().max() <= ref.abs().max() * 2 ** -8  # within half a bf16 ulp of the largest


def test_attnres_under_autocast(cfg):
    from k3.model.attnres import AttnRes

    for impl in ("naive", "blockwise"):
        ar = AttnRes(cfg, impl=impl)
        with torch.no_grad():
            for q in ar.pseudo_query:
                q.normal_(0, 0.5)
        emb = torch.randn(2, 12, cfg.d_model)
        ys = [torch.randn(2, 12, cfg.d_model) for _ in range(ar.n_sublayers)]

        def run():
            st, hs = ar.start(emb), []
            for j, y in enumerate(ys):
                hs.append(ar.mix(st, j))
                ar.push(st, j, y.bfloat16() if torch.is_autocast_enabled("cpu") else y)
            return torch.stack([h.float() for h in hs] + [ar.final(st).float()])

        ref, low = both(run)
        assert rel_err(low, ref) < TOL, impl


def test_attnres_softmax_stays_fp32():
    from k3.ops.attnres import attnres_mix, phase1

    s, q, g = torch.randn(3, 2, 5, 64), torch.randn(64), torch.rand(64)
    with torch.autocast(**BF16):
        _, w = attnres_mix(s, q, g)
        stats = phase1(s, q[None], g[None], 1e-6)
    assert w.dtype == torch.float32 and stats.m.dtype == torch.float32 and stats.l.dtype == torch.float32


def test_whole_model_logits_and_loss_under_autocast(cfg):
    from k3.model.transformer import K3Model

    model = K3Model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 33))

    def run():
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        return logits, loss

    (l32, loss32), (l16, loss16) = both(run)
    assert loss16.dtype == torch.float32
    assert rel_err(l16, l32) < TOL
    assert abs(float(loss16) - float(loss32)) < 1e-2 * float(loss32)


# ---------------------------------------------------------------------- auto: the probe and its cache
def fake(step_fp32: float, step_bf16: float | None, mm_bf16: float = 0.5) -> dict:
    return {"matmul_fp32_s": 1.0, "matmul_bf16_s": mm_bf16, "step_fp32_s": step_fp32 if step_bf16 else None,
            "step_bf16_s": step_bf16, "measured_at": "2026-01-01"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "precision.json"


def test_auto_follows_the_probe(cache):
    calls = []

    def probe(result):
        return lambda: calls.append(1) or result

    p, why = prec.resolve_precision("auto", "cpu", probe_fn=probe(fake(1.0, 2.0)), use_cache=False)
    assert p == "fp32" and "0.50x" in why and "matmul 2.00x" in why  # a faster matmul alone does not decide
    p, why = prec.resolve_precision("auto", "cpu", probe_fn=probe(fake(1.0, 0.75)), use_cache=False)
    assert p == "bf16" and "1.33x" in why
    p, _ = prec.resolve_precision("auto", "cpu", probe_fn=probe(fake(1.0, 1 / 1.05)), use_cache=False)
    assert p == "fp32"  # faster, but within the margin that noise could give
    p, why = prec.resolve_precision("auto", "cpu", probe_fn=probe(fake(0, None, mm_bf16=250.0)), use_cache=False)
    assert p == "fp32" and "not tried" in why
    assert len(calls) == 4 and not cache.exists()
    # given precisions and CUDA never probe
    assert prec.resolve_precision("bf16", "cpu", probe_fn=probe(fake(1.0, 2.0)))[0] == "bf16"
    assert prec.resolve_precision("fp32", "cpu", probe_fn=probe(fake(1.0, 0.5)))[0] == "fp32"
    assert prec.resolve_precision("auto", "cuda", probe_fn=probe(fake(1.0, 2.0)))[0] == "bf16"
    assert len(calls) == 4
    with pytest.raises(ValueError, match="choose one of auto, fp32, bf16"):
        prec.resolve_precision("fp16", "cpu")
    with pytest.raises(ValueError, match="must give matmul_fp32_s"):
        prec.resolve_precision("auto", "cpu", probe_fn=lambda: {"step": 1}, use_cache=False)


def test_cache_written_read_and_corrupt(cache):
    calls = []

    def probe():
        calls.append(1)
        return fake(1.0, 0.5)

    p, why = prec.resolve_precision("auto", "cpu", probe_fn=probe)
    assert p == "bf16" and "cached" not in why and len(calls) == 1
    data = json.loads(cache.read_text())
    assert data["hosts"][prec.host_key()]["step_bf16_s"] == 0.5
    p, why = prec.resolve_precision("auto", "cpu", probe_fn=probe)
    assert p == "bf16" and "2.00x" in why and "2026-01-01, cached" in why and len(calls) == 1
    # another thread count is another entry: measured on its own
    n = torch.get_num_threads()
    torch.set_num_threads(n + 1)
    try:
        prec.resolve_precision("auto", "cpu", probe_fn=probe)
    finally:
        torch.set_num_threads(n)
    assert len(calls) == 2 and len(json.loads(cache.read_text())["hosts"]) == 2
    # a damaged cache is ignored and rewritten, never an error
    for damage in ("{not json", json.dumps({"version": 1, "hosts": {prec.host_key(): {"matmul_fp32_s": "x"}}}),
                   json.dumps([1, 2])):
        cache.write_text(damage)
        assert prec.resolve_precision("auto", "cpu", probe_fn=probe)[0] == "bf16"
        assert prec.host_key() in json.loads(cache.read_text())["hosts"]
    assert len(calls) == 5


def test_unwritable_cache_still_resolves(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("K3_CACHE_DIR", str(blocker / "sub"))  # a folder under a file: cannot be made
    assert prec.resolve_precision("auto", "cpu", probe_fn=lambda: fake(1.0, 2.0))[0] == "fp32"


def test_cache_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "a"))
    assert prec.cache_path() == tmp_path / "a" / "precision.json"
    monkeypatch.delenv("K3_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert prec.cache_path() == tmp_path / "x" / "k3" / "precision.json"


def test_probe_runs_and_reports(monkeypatch):
    """The real probe, at a toy size: every figure there, the RNG left as it was."""
    state = torch.random.get_rng_state()
    r = prec.probe(matmul_size=64, batch=1, seq_len=8, n_layers=2, repeats=1, budget_s=0.0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert r["matmul_fp32_s"] > 0 and r["matmul_bf16_s"] > 0 and r["threads"] == torch.get_num_threads()
    assert (r["step_bf16_s"] is None) == (r["matmul_bf16_s"] > r["matmul_fp32_s"])
    assert prec.decide(r)[0] in ("fp32", "bf16")


# ---------------------------------------------------------------------- the commands take the flag
@pytest.mark.parametrize("argv", [["train"], ["demo"], ["eval"], ["sample"], ["serve"]])
def test_every_command_takes_precision(argv):
    from k3.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(argv).precision == "auto"
    assert parser.parse_args([*argv, "--precision", "bf16"]).precision == "bf16"
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--precision", "fp16"])


def test_engine_checks_precision():
    from k3.model.transformer import K3Model
    from k3.serve.engine import Engine

    model = K3Model(get_config("tiny"))
    with pytest.raises(ValueError, match="give fp32 or bf16"):
        Engine(model, precision="auto")
    engine = Engine(model, precision="bf16")
    out = engine.generate([[1, 2, 3]], None)
    assert len(out) == 1


# ---------------------------------------------------------------------- training in bf16
def test_bf16_training_keeps_fp32_weights_and_state(tmp_path, fake_data):
    cfg, data = get_config("tiny"), fake_data()
    tc = TrainConfig(steps=2, batch_size=2, seq_len=16, eval_batches=1, warmup_steps=1, precision="bf16")
    t = Trainer(cfg, tc, data, data, tmp_path)
    r = t.fit()
    assert len(r.losses) == 2 and all(map(lambda x: x == x, r.losses))
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    opts = getattr(t.optimizer, "optimizers", {"": t.optimizer}).values()
    states = [v for o in opts for s in o.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert states and all(v.dtype == torch.float32 for v in states)
    assert t.precision_reason == "--precision bf16 given"
    from k3.train.metrics import read_metrics

    assert {rec["precision"] for rec in read_metrics(tmp_path / "metrics.jsonl") if rec["kind"] == "train"} == {"bf16"}


def test_trainer_resolves_auto(tmp_path, fake_data, cache, monkeypatch):
    monkeypatch.setattr(prec, "probe", lambda: fake(1.0, 2.0))  # bf16 slower here: auto is fp32
    cfg, data = get_config("tiny"), fake_data()
    tc = TrainConfig(steps=1, batch_size=2, seq_len=16, eval_batches=1, warmup_steps=0, precision="auto")
    t = Trainer(cfg, tc, data, None, None)
    assert t.tc.precision == "fp32" and "below the 1.1x" in t.precision_reason
    assert tc.precision == "fp32"  # the caller's config names what runs
