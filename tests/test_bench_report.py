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
    old = old.replace("| 0.98 | >= 3x |", "| 0.98 | >= 3x |\n| qat | old label (`settings.k3.recovery`) | 10,149 | >= 0.8 |\n"
                      "| qat | a key no longer reported (`settings.gone`) | 1 | |")
    new = report.render(tmp_path, old)
    # an earlier run's values stay, under today's label and target; keys no longer reported are dropped
    label, target = next((lab, t) for k, lab, t in report.HEADLINES["kda"] if k == "speedup_vs_fla_naive_chunk")
    # ... and say so in the row itself, not only in the machine list
    assert f"| kda | {report.KEPT} {label} (`speedup_vs_fla_naive_chunk`) | 12 | {target} |" in new
    qat_label = next(lab for k, lab, t in report.HEADLINES["qat"] if k == "settings.k3.recovery")
    assert f"| qat | {report.KEPT} {qat_label} (`settings.k3.recovery`) | 10,149 |  |" in new
    assert "settings.gone" not in new and new.count(report.KEPT) == 2  # the rerun moe row is not marked
    assert report.render(tmp_path, new) == new  # a rebuild does not stack the mark
    # the carried-over rows form a table of their own, after the measured one
    measured, carried = new.split("Carried over from earlier runs", 1)
    assert "| 1.5 | >= 3x |" in measured and report.KEPT not in measured
    assert carried.count(report.KEPT) == 2 and "| benchmark | measure | value | target |" in carried
    assert "old MoE row" not in new and "| 1.5 | >= 3x |" in new
    assert "- `moe`: hostB, 2, torch 2.13.0+cpu" in new
    assert "- `kda`: hostA, 2, torch 2.13.0+cpu (earlier run)" in new
    assert "- `qat-start0.5`: hostA, 2, torch 2.13.0+cpu (earlier run)" in new


def test_lookup_reads_keys_that_hold_dots(load_benchmark):
    """A sweep names its points by their settings (`lr0.002-b8-bf16`): the dotted path finds them whole."""
    lookup = load_benchmark("report").lookup
    d = {"points": {"lr0.002-b8-bf16": {"steps": 410}, "lr0.002": {"steps": 1}}, "threads": {"2": {"x": 3.5}}}
    assert lookup(d, "points.lr0.002-b8-bf16.steps") == 410
    assert lookup(d, "points.lr0.002.steps") == 1
    assert lookup(d, "threads.2.x") == 3.5
    assert lookup(d, "points.lr0.003-b8-bf16.steps") is None and lookup(d, "threads.2.x.y") is None
