"""`k3 plan` end to end, in process (tiny preset)."""
import json

from k3.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def _run(capsys, *argv):
    code = main(["plan", "--preset", "tiny", "--hardware", "h100", "--context", "1024", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_and_json(capsys):
    code, out, _ = _run(capsys, "--pp", "2", "--batch", "2")
    assert code == 0
    for section in ("memory", "bandwidth (decode)", "communication", "compute", "latency"):
        assert f"\n{section}\n" in out
    assert "MLA latent cache" in out and "time to first token" in out
    code, out, _ = _run(capsys, "--json", "--train", "--dp", "2", "--ep", "2")
    d = json.loads(out)
    assert code == 0 and d["plan"]["mode"] == "train"
    assert {"memory", "communication", "compute", "latency"} <= set(d["plan"])
    assert d["plan"]["memory"]["activations_checkpointing"] > 0


def test_what_ifs_and_min_gpus(capsys):
    code, out, _ = _run(capsys, "--what-if", "no-latentmoe,bf16-experts")
    assert code == 0 and "no-latentmoe" in out and "x2 " in out  # the a2a column doubles
    code, out, _ = _run(capsys, "--min-gpus", "--json")
    assert code == 0 and json.loads(out)["min_gpus"]["gpus"] == 1  # tiny fits on one H100


def test_errors_are_one_line(capsys):
    code, _, err = _run(capsys, "--tp", "3")
    assert code == 2 and "tensor-parallel sizes that fit: 1, 2" in err and "Traceback" not in err
    code, _, err = _run(capsys, "--hardware", "tpu9")
    assert code == 2 and "unknown hardware 'tpu9'" in err
    code, _, err = _run(capsys, "--context", "0")
    assert code == 2 and "context = 0 must be a positive number" in err
    code, _, err = _run(capsys, "--what-if", "no-kda")
    assert code == 2 and "unknown ['no-kda']" in err


def test_plot(tmp_path, capsys):
    path = tmp_path / "walls.png"
    code, out, _ = _run(capsys, "--plot", str(path), "--what-if", "all-kda", "--json")
    assert code == 0 and path.read_bytes()[:8] == PNG
    assert json.loads(out)["plot"] == str(path)


def test_plot_is_for_serving(capsys, tmp_path):
    from k3.cli import main
    assert main(["plan", "--preset", "tiny", "--train", "--plot", str(tmp_path / "p.png")]) == 2
    assert "drop --train" in capsys.readouterr().err and not (tmp_path / "p.png").exists()


def test_min_gpus_names_a_context_past_max_context(capsys):
    from k3.cli import main
    assert main(["plan", "--preset", "mini", "--min-gpus", "--context", "1048576"]) == 2  # mini's is 4096
    err = capsys.readouterr().err
    assert "exceeds mini's max_context = 4096" in err and "bigger GPUs" not in err


def test_hardware_file_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntflops: {bf16: [1\n")
    code, _, err = _run(capsys, "--hardware", str(bad))
    assert code == 2 and f"{bad}: not valid YAML (" in err and "Traceback" not in err
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 16)
    code, _, err = _run(capsys, "--hardware", str(binary))
    assert code == 2 and f"{binary}: not a text file" in err
    code, _, err = _run(capsys, "--hardware", str(tmp_path))
    assert code == 2 and "is a directory" in err and "does not exist" not in err


def test_hardware_file_types_are_checked(tmp_path, capsys):
    import yaml

    from k3.plan.hardware import load_hardware

    from importlib import resources

    base = yaml.safe_load((resources.files("k3.plan") / "hardware" / "h100.yaml").read_text())
    for field, value, words in (("nvlink_domain", 0.5, "nvlink_domain = 0.5 must be a positive whole number"),
                                ("nvlink_domain", True, "nvlink_domain = True"),
                                ("tflops", {"bf16": True}, "tflops.bf16 = True must be a positive number"),
                                ("memory_gb", True, "memory_gb = True must be a positive number"),
                                # a unit mistake: every time came out infinite (Infinity in --json, not JSON)
                                ("nvlink_gb_s", 1e-320, "nvlink_gb_s = 1e-320 GB/s is outside [1e-06, 1e+09] GB/s"),
                                ("tflops", {"bf16": 3e12}, "tflops.bf16 = 3000000000000.0 TFLOP/s is outside")):
        path = tmp_path / f"{field}.yaml"
        path.write_text(yaml.safe_dump({**base, field: value}))
        code, _, err = _run(capsys, "--hardware", str(path))
        assert code == 2 and words in err, err
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump({**base, "nvlink_domain": 8.0}))
    assert load_hardware(str(path)).nvlink_domain == 8
    # YAML 1.1 reads 1e3 as text: the message says how to write the number
    text = (resources.files("k3.plan") / "hardware" / "h100.yaml").read_text()
    field = next(line.split(":")[0] for line in text.splitlines() if line.startswith("memory_gb:"))
    path.write_text("\n".join("memory_gb: 1e3" if line.startswith(field + ":") else line for line in text.splitlines()))
    code, _, err = _run(capsys, "--hardware", str(path))
    assert code == 2 and "memory_gb = '1e3' must be a positive number (YAML reads that as text" in err, err


def test_min_gpus_refuses_layout_flags_and_train(capsys):
    code, _, err = _run(capsys, "--min-gpus", "--tp", "8")
    assert code == 2 and "drop --tp" in err
    code, _, err = _run(capsys, "--min-gpus", "--pp", "1", "--dp", "2")
    assert code == 2 and "drop --pp --dp" in err
    code, _, err = _run(capsys, "--min-gpus", "--train")
    assert code == 2 and "--min-gpus plans serving; drop --train" in err


def test_plot_path_checked_before_planning(tmp_path, capsys, monkeypatch):
    import k3.plan.walls as walls

    def boom(*a, **k):
        raise AssertionError("planned before checking --plot")

    monkeypatch.setattr(walls, "plan", boom)
    code, _, err = _run(capsys, "--plot", str(tmp_path))
    assert code == 2 and "is a directory" in err and ".tmp" not in err
    (tmp_path / "f").write_text("")
    code, _, err = _run(capsys, "--plot", str(tmp_path / "f" / "w.png"))
    assert code == 2 and "is a file, not a directory" in err
    code, _, err = _run(capsys, "--plot", str(tmp_path / "walls.txt"))  # a PNG under another name
    assert code == 2 and "ending in .png" in err and not (tmp_path / "walls.txt").exists()


def test_default_context_fits_the_preset(capsys):
    """Without --context a preset shorter than K3's 1M-token context plans its own max_context (tiny and mini
    failed every run until --context was given); K3 itself keeps 1,048,576. An explicit one past it is refused."""
    from k3.config import get_config

    assert main(["plan", "--preset", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["options"]["context"] == get_config("tiny").max_context
    assert main(["plan", "--preset", "k3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["options"]["context"] == 1_048_576
    assert main(["plan", "--preset", "tiny", "--context", "1048576"]) == 2
    assert "exceeds tiny's max_context" in capsys.readouterr().err
