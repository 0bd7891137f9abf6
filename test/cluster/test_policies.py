"""Router policies `histate cluster` accepts; cache_aware is refused with its reason (cluster/policies.py)."""
from pathlib import Path

import pytest

from histate.cli import main
from histate.cluster.workload import cluster_workload


def test_cache_aware_is_refused_with_a_one_line_reason(capsys):
    assert main(["cluster", "--router-policy", "cache_aware"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cache_aware" in err and "input_ids" in err


def test_the_chosen_policy_reaches_the_router(monkeypatch, tmp_path):
    import histate.cluster.run as run
    from histate.cluster.router import Router
    from histate.cluster.workers import WorkerPool

    seen = []

    def record_and_stop(self):
        seen.append(self.argv(1, 2))
        raise RuntimeError("stop before starting a router")

    monkeypatch.setattr(WorkerPool, "start", lambda self: [])
    monkeypatch.setattr(Router, "start", record_and_stop)
    workload = cluster_workload(1, 2, 0)
    with pytest.raises(RuntimeError, match="stop before"):
        run._one_run("no-l3+kill", workload, run.ClusterOptions(router_policy="round_robin"), Path(tmp_path))
    argv = seen[0]
    assert argv[argv.index("--policy") + 1] == "round_robin"
