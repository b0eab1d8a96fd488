"""`k3 ablate`'s default job count: the cores busy now (a /proc/stat sample), not the lagging load average."""
import os

import k3.train.device as device
from k3.ablate.runner import auto_jobs


def test_auto_jobs_follows_the_busy_cores_now(monkeypatch):
    n = os.cpu_count() or 1
    monkeypatch.setattr(device, "busy_cores", lambda sample_s=0.5: float(n))
    assert auto_jobs() == 1
    monkeypatch.setattr(device, "busy_cores", lambda sample_s=0.5: 0.0)
    assert auto_jobs() == n
    monkeypatch.setattr(device, "busy_cores", lambda sample_s=0.5: None)  # no /proc/stat: the load average
    assert 1 <= auto_jobs() <= n
