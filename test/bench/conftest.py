"""Fixtures of the bench tests: one `histate serve` engine per session, served in-process.

The server is the real thing (reference executor, histate.core, SSD store on disk via the file
backend) on its own event loop thread; `check_mirror` proves after every request that each tier holds
exactly what the policy placed there. Everything here needs aiohttp; the server also needs the
`reference` extra and sgl-kernel-ext.
"""
import pytest

pytest.importorskip("aiohttp")


@pytest.fixture(scope="session")
def histate_server(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("histate_kernels")
    from histate.serve.engine import ServeConfig, ServingEngine
    from histate.serve.http import ServerThread

    config = ServeConfig("histate", ssd_dir=tmp_path_factory.mktemp("ssd"), ssd_backend="file", check_mirror=True)
    server = ServerThread(ServingEngine(config))
    yield server
    server.close()
