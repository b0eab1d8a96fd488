"""k3 ablate: matched small-scale ablations of every K3 design choice, with verdicts per claim.

    from k3.ablate import SCALES, select, plan_runs, run_plan, aggregate
    plan = plan_runs(SCALES["quick"], select("core"), data_fingerprint(files))
    results = run_plan(plan, "runs/ablate-quick", "runs/data")
    summary = aggregate(plan, results)

Parts: `suites` (the groups, variants and claims as data), `runner` (cache keys, execution, resume),
`probe` (needle retrieval at increasing lengths), `stats` (paired t intervals, verdicts), `report`
(results.json, results.md, plots), `cli` (`k3 ablate`).
"""
from k3.ablate.report import aggregate, markdown, write_report
from k3.ablate.runner import RunSpec, data_fingerprint, execute, plan_runs, run_plan
from k3.ablate.suites import SCALES, SUITES, Scale, build_groups, matched_moe_overrides, select

__all__ = [
    "RunSpec", "SCALES", "SUITES", "Scale", "aggregate", "build_groups", "data_fingerprint", "execute",
    "markdown", "matched_moe_overrides", "plan_runs", "run_plan", "select", "write_report",
]
