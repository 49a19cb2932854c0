"""One plain ``kvos serve`` (the default model, ``--max-model-len 512``) per test process, shared
by the modules that need nothing else: a server start costs ~15 s of the suite's time. Tests on
it compare against their own before/after readings, never against a fresh server's state."""
from __future__ import annotations

import pytest

from tests.support.server import Server


@pytest.fixture(scope="session")
def default_server():
    s = Server("--max-model-len", "512").wait_ready()
    yield s
    s.stop()
