"""benchmarks/report.py rebuilds the measured table from the JSON files present and keeps, from the doc's
current table, the rows and machine lines of every benchmark not rerun."""
import json


def test_partial_rerun_keeps_earlier_rows_and_machine_lines(load_benchmark, tmp_path):
    report = load_benchmark("report")
    (tmp_path / "moe.json").write_text(json.dumps({
        "speedup_vs_loop": 1.5, "machine": {"platform": "hostB", "cpu_count": 2}, "torch": "2.13.0+cpu"}))
    old = "\n".join([
        "| benchmark | measure | value | target |", "|---|---|---:|---|",
        "| kda | KDA row (`speedup_vs_fla_naive_chunk`) | 12 | >= 10x |",
        "| moe | old MoE row (`speedup_vs_loop`) | 0.98 | >= 3x |",
        "", "Machines as recorded in each JSON:",
        "- `kda`: hostA, 2, torch 2.13.0+cpu",
        "- `moe`: hostA, 2, torch 2.13.0+cpu",
        "- `qat-start0.5`: hostA, 2, torch 2.13.0+cpu",   # a run with no headline rows of its own
    ])
    new = report.render(tmp_path, old)
    assert "| kda | KDA row (`speedup_vs_fla_naive_chunk`) | 12 | >= 10x |" in new
    assert "old MoE row" not in new and "| 1.5 | >= 3x |" in new
    assert "- `moe`: hostB, 2, torch 2.13.0+cpu" in new
    assert "- `kda`: hostA, 2, torch 2.13.0+cpu (earlier run)" in new
    assert "- `qat-start0.5`: hostA, 2, torch 2.13.0+cpu (earlier run)" in new
