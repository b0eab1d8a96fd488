import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from k3.config import get_config
from k3.train import checkpoint as ckpt
from k3.train.optim import build_optimizer


class Net(nn.Module):
    def __init__(self, tie: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 8)
        self.experts = nn.Parameter(torch.randn(3, 8, 4))
        self.head = nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.register_buffer("balance_bias", torch.zeros(3))  # like a router's balancing bias

    def forward(self, x):
        h = self.lin(self.embed(x))
        h = h + torch.einsum("btd,edf->btf", h, self.experts).sum(-1, keepdim=True)
        return self.head(h)


def _train(model, opt, steps):
    for _ in range(steps):
        x = torch.randint(0, 16, (2, 5))
        loss = model(x).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.balance_bias += 0.001


@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_round_trip_model_optimizer_rng(tmp_path, opt_name):
    torch.manual_seed(0)
    model = Net()
    opt = build_optimizer(model, opt_name, lr=1e-2)
    _train(model, opt, 3)
    cfg = get_config("tiny")
    path = ckpt.save_checkpoint(tmp_path, 3, model, opt, cfg, data_state={"next_step": 3})
    assert path.name == "step_000003" and (tmp_path / "latest").read_text().strip() == "step_000003"
    expect_rand = (torch.rand(4), np.random.rand(), __import__("random").random())

    torch.manual_seed(123)  # scramble RNGs and state
    model2 = Net()
    opt2 = build_optimizer(model2, opt_name, lr=1e-2)
    manifest = ckpt.load_checkpoint(tmp_path, model2, opt2, cfg)
    assert manifest["step"] == 3 and manifest["data"] == {"next_step": 3}
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.safetensors"}
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ("model.safetensors", "optimizer.safetensors", "manifest.json"):  # safetensors makes 0600 files
        assert (path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    got_rand = (torch.rand(4), np.random.rand(), __import__("random").random())
    assert torch.equal(expect_rand[0], got_rand[0]) and expect_rand[1:] == got_rand[1:]
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    assert model2.balance_bias[0].item() == pytest.approx(0.003)  # buffers are saved
    # continuing both gives identical parameters: optimizer state came back exactly
    torch.manual_seed(7)
    _train(model, opt, 2)
    torch.manual_seed(7)
    _train(model2, opt2, 2)
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n


def test_tied_weights(tmp_path):
    model = Net(tie=True)
    ckpt.save_checkpoint(tmp_path, 1, model)
    m2 = Net(tie=True)
    ckpt.load_checkpoint(tmp_path, m2)
    assert torch.equal(m2.head.weight, model.embed.weight) and m2.head.weight is m2.embed.weight


def test_keep_last_n_and_latest(tmp_path):
    model = Net()
    for step in range(1, 6):
        ckpt.save_checkpoint(tmp_path, step, model, keep_last=2)
    assert [p.name for _, p in ckpt.step_dirs(tmp_path)] == ["step_000004", "step_000005"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000005"
    # re-saving an existing step replaces it atomically
    ckpt.save_checkpoint(tmp_path, 5, model, keep_last=2)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000005"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_corrupted_file_is_named(tmp_path):
    model = Net()
    opt = build_optimizer(model, "adamw")
    _train(model, opt, 1)
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt)
    f = path / "optimizer.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer\.safetensors.*sha256"):
        ckpt.load_checkpoint(tmp_path, Net(), build_optimizer(Net(), "adamw"))
    # truncated model file
    m = path / "model.safetensors"
    m.write_bytes(m.read_bytes()[:-10])
    with pytest.raises(ckpt.CheckpointError, match=r"model\.safetensors.*size.*resume from an earlier step"):
        ckpt.read_manifest(path)
    good = json.loads((path / "manifest.json").read_text())
    for broken in (None, {**good, "files": {}}, {**good, "files": {"model.safetensors": {"bytes": 1}}}):
        (path / "manifest.json").write_text(json.dumps(broken))  # structure, not just syntax
        with pytest.raises(ckpt.CheckpointError, match=r"manifest\.json.*(not a manifest|'files').*delete"):
            ckpt.read_manifest(path, verify=False)
    (path / "manifest.json").write_text("{ not json")
    with pytest.raises(ckpt.CheckpointError, match=r"manifest\.json.*JSON"):
        ckpt.load_checkpoint(path, Net())


@pytest.mark.parametrize("field,value,says", [
    ("step", "x", "field 'step' is 'x', not a step count"),
    ("step", -1, "field 'step' is -1"),
    ("config", [], "field 'config' is list, not an object"),
    ("data", None, "field 'data' is NoneType, not an object"),
    ("model_aliases", None, "field 'model_aliases' is NoneType"),
    ("model_aliases", {"a": 1}, "field 'model_aliases' must map tensor names to tensor names"),
    ("rng", [], "field 'rng' is list"),
    ("rng", {}, "field 'rng' is not a saved random state"),
])
def test_manifest_fields_of_the_wrong_type_are_named(tmp_path, field, value, says):
    """Valid JSON with a field of the wrong type gave KeyError / TypeError / AttributeError tracebacks, or (config
    null) skipped the config check; the manifest is not covered by the file hashes."""
    model = Net()
    opt = build_optimizer(model, "adamw")
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, config={"d": 1})
    m = json.loads((path / "manifest.json").read_text())
    m[field] = value
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ckpt.CheckpointError, match=r"manifest\.json: " + says.replace("(", r"\(").replace(")", r"\)")):
        ckpt.load_checkpoint(tmp_path, Net(), build_optimizer(Net(), "adamw"))


def test_the_model_loads_without_its_optimizer_file(tmp_path):
    """Deleting optimizer.safetensors (to save space) made the model unloadable for eval and sampling; resuming
    training still needs it and says so."""
    model = Net()
    opt = build_optimizer(model, "adamw")
    _train(model, opt, 1)
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt)
    (path / "optimizer.safetensors").unlink()
    other = Net()
    ckpt.load_checkpoint(tmp_path, other)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer\.safetensors: missing"):
        ckpt.load_checkpoint(tmp_path, Net(), build_optimizer(Net(), "adamw"))


def test_config_and_shape_mismatch_are_named(tmp_path):
    model = Net()
    ckpt.save_checkpoint(tmp_path, 1, model, config=get_config("tiny"))
    with pytest.raises(ckpt.CheckpointError, match=r"manifest\.json.*'d_model' is 64.*128"):
        ckpt.load_checkpoint(tmp_path, Net(), config=get_config("tiny", d_model=128))

    class Other(Net):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 9)

    with pytest.raises(ckpt.CheckpointError, match=r"model\.safetensors"):
        ckpt.load_checkpoint(tmp_path, Other())
    with pytest.raises(ckpt.CheckpointError, match="no optimizer state"):
        ckpt.load_checkpoint(tmp_path, Net(), build_optimizer(Net(), "adamw"))
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "nope", Net())


def test_checkpoint_saved_before_kda_norm_eps_loads_with_the_eps_it_was_trained_with(tmp_path):
    """A manifest whose config predates `kda_norm_eps` loads (the field reads as norm_eps, what KDA used then);
    resuming it under the new default is refused, naming the field."""
    from k3.model.transformer import K3Model
    from k3.io.trained import load_trained_model

    old = get_config("tiny", kda_norm_eps=get_config("tiny").norm_eps)
    torch.manual_seed(0)
    model = K3Model(old)
    ckpt.save_checkpoint(tmp_path, 1, model, config=old)
    mpath = ckpt.latest_checkpoint(tmp_path) / ckpt.MANIFEST
    manifest = json.loads(mpath.read_text())
    del manifest["config"]["kda_norm_eps"]
    mpath.write_text(json.dumps(manifest))
    loaded, _ = load_trained_model(tmp_path)
    assert loaded.config.kda_norm_eps == 1e-6
    x = torch.randint(0, old.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model.eval()(x), rtol=0, atol=0)
    with pytest.raises(ckpt.CheckpointError, match="'kda_norm_eps' is 1e-06 in the checkpoint but 0.0001"):
        ckpt.load_checkpoint(tmp_path, K3Model(get_config("tiny")), config=get_config("tiny"))


def test_optimizer_of_another_kind_is_rejected(tmp_path):
    model = Net()
    opt = build_optimizer(model, "muon")
    _train(model, opt, 1)
    ckpt.save_checkpoint(tmp_path, 1, model, opt)
    with pytest.raises(ckpt.CheckpointError, match="optimizer"):
        ckpt.load_checkpoint(tmp_path, Net(), build_optimizer(Net(), "adamw"))


CHILD = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {tests!r})
    from test_train_checkpoint import Net
    from k3.train import checkpoint as ckpt
    root, marker, where = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model = Net()
    ckpt.save_checkpoint(root, 1, model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    def stall(*a, **k):
        open(marker, "w").close()
        time.sleep(120)
    if where == "tensors":  # die after the model file is half written
        real = ckpt.save_file
        def save_file(t, path):
            real(t, path)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            stall()
        ckpt.save_file = save_file
    else:  # die after the new step directory is in place, before `latest` moves
        ckpt.atomic_write_text = stall
    ckpt.save_checkpoint(root, 2, model)
""")


@pytest.mark.parametrize("where", ["tensors", "pointer"])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, where):
    root, marker = tmp_path / "ckpt", tmp_path / "marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=str(Path(__file__).parent)),
                             str(root), str(marker), where], env=env)
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert proc.poll() is None, "child exited before the crash point"
            assert time.time() < deadline, "child never reached the crash point"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    torch.manual_seed(0)
    expected = Net()
    latest = ckpt.latest_checkpoint(root)
    assert latest.name == "step_000001"
    model = Net()
    ckpt.load_checkpoint(root, model)
    for (n, a), (_, b) in zip(expected.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".step_")]
    if where == "tensors":  # the half-written save is invisible: only a hidden temporary directory
        assert leftovers and not (root / "step_000002").exists()
    ckpt.save_checkpoint(root, 3, model)  # the next save cleans up and succeeds
    assert not [p for p in root.iterdir() if p.name.startswith(".step_")]
    assert ckpt.latest_checkpoint(root).name == "step_000003"
    assert json.loads((root / "step_000003" / "manifest.json").read_text())["step"] == 3


def test_a_checkpoint_that_records_only_its_tokenizer_hash_finds_the_tokenizer_above_it(tiny_data_dir, tmp_path):
    """`k3 rl` / `k3 distill` checkpoints record extra.tokenizer_sha256 and keep tokenizer.json in the experiment
    root: `k3 serve`, `k3 sample` and `--policy k3` find it there (and refuse another tokenizer given by path)."""
    import shutil

    import pytest

    from k3.config import get_config
    from k3.data import load_tokenizer
    from k3.model.transformer import K3Model
    from k3.train.checkpoint import save_checkpoint
    from k3.io.trained import checkpoint_tokenizer, load_trained_model

    shutil.copy(tiny_data_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    model = K3Model(get_config("tiny"))
    save_checkpoint(tmp_path / "run" / "checkpoint", 1, model, config=model.config,
                    extra={"tokenizer_sha256": tok.fingerprint})
    _, manifest = load_trained_model(tmp_path / "run" / "checkpoint")
    assert checkpoint_tokenizer(manifest, 512).fingerprint == tok.fingerprint
    (tmp_path / "tokenizer.json").rename(tmp_path / "elsewhere.json")
    with pytest.raises(ValueError, match="does not name its tokenizer"):
        checkpoint_tokenizer(manifest, 512)
    _, manifest2 = load_trained_model(tmp_path / "run" / "checkpoint")
    manifest2["extra"]["tokenizer_sha256"] = "0" * 64  # another tokenizer's hash: the one given is refused
    with pytest.raises(ValueError, match="is not the one"):
        checkpoint_tokenizer(manifest2, 512, tmp_path / "elsewhere.json")


def test_latest_naming_a_distributed_checkpoint_is_not_called_incomplete(tmp_path, caplog):
    """A distributed checkpoint (k3.parallel's k3.json, no manifest) is complete: looking for a single-process one
    beside it finds none without warning of a crash; a step dir with neither file still gets the warning."""
    (tmp_path / "step_000006").mkdir()
    (tmp_path / "step_000006" / "k3.json").write_text("{}")
    (tmp_path / "latest").write_text("step_000006")
    assert ckpt.latest_checkpoint(tmp_path) is None and "not a complete checkpoint" not in caplog.text
    (tmp_path / "step_000006" / "k3.json").unlink()
    assert ckpt.latest_checkpoint(tmp_path) is None and "not a complete checkpoint" in caplog.text
