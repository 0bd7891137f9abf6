"""Fixtures of the exactness suite: one reference model per numerics mode, cold runs memoised.

torch is pinned to one thread for every test here: with two threads, OpenMP spin-waits on a shared
2-core CI box make run times swing 10x (research/refmodel.md), and results must not depend on it.
"""
import pytest

try:
    import torch
except ImportError:  # test modules skip themselves with importorskip; fixtures are never used then
    torch = None


@pytest.fixture(autouse=True)
def _one_torch_thread():
    if torch is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def runners():
    """numerics -> ModelRunner, built on first use (about 0.2 s each)."""
    from histate.reference.runner import ModelRunner

    built = {}

    def get(numerics: str) -> ModelRunner:
        if numerics not in built:
            built[numerics] = ModelRunner(numerics)
        return built[numerics]

    return get


@pytest.fixture(scope="session")
def cold_runs(runners):
    """(numerics, token_ids) -> ColdRun with 3 greedy decode steps, computed once per session."""
    memo = {}

    def get(numerics: str, token_ids) -> object:
        key = (numerics, tuple(token_ids))
        if key not in memo:
            memo[key] = runners(numerics).cold_run(list(token_ids), num_decode_steps=3)
        return memo[key]

    return get
