"""``kvos bench serve --launch``: the same token-id requests through ``LLM.generate`` and through a
real ``kvos serve`` it starts; on the CPU (float32) every streamed output must equal the offline one."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport", [" --transport process"], ids=["engine-process"])  # the in-process
# transport is every other server test's
def test_launch_compares_server_with_offline(transport, tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "-m", "kvos.cli", "bench", "serve", "--launch",
                    "--model llama-tiny --random-weights --num-blocks 256" + transport, "--requests", "12",
                    "--concurrency", "6", "--input-len", "24", "--max-tokens", "8", "--client-processes", "2",
                    "--output", str(out)], check=True, timeout=600, capture_output=True)
    r = json.loads(out.read_text())
    assert r["identical_outputs"] == 12
    assert r["http"]["requests_ok"] == 12 and r["http"]["requests_failed"] == 0
    assert r["http"]["output_tok_s"] > 0 and r["offline"]["output_tok_s"] > 0
    assert r["summary"]["http_over_offline"] == round(r["http"]["output_tok_s"] / r["offline"]["output_tok_s"], 3)
    assert any(line.startswith("weights ") for line in r["startup_phases"])
    # the engine's step counters (the server's /metrics, the offline engine's stats) count every token
    # computed: 12 x (24 prompt + 7 fed-back outputs), less the 16-token blocks the warm-up cached
    counted = [r[k]["engine_steps"]["batched_tokens"] for k in ("offline", "http")]
    assert counted[0] == counted[1] and 12 * 31 - 8 * 16 <= counted[0] <= 12 * 31, counted  # the engine logged its phases
