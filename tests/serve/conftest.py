"""One plain ``kvos serve`` (the default model, ``--max-model-len 512``) per test process, shared
by the modules that need nothing else: a server start costs ~15 s of the suite's time. Tests on
it compare against their own before/after readings, never against a fresh server's state. A
module that needs other flags defines its own ``server``; ``client`` follows whichever it uses."""
from __future__ import annotations

import openai
import pytest

from tests.support.server import Server


@pytest.fixture(scope="session")
def server():
    s = Server("--max-model-len", "512").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
