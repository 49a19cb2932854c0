"""The ``kvos`` command as a user runs it (real subprocesses)."""
from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def kvos(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvos.cli", *args], input=stdin, capture_output=True,
                          text=True, env=ENV, timeout=300)


def test_generate_streams_text_and_prints_stats():
    r = kvos("generate", "The capital of France is", "--max-tokens", "8", "--stats")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "KV cache:" in r.stdout and "prefix" in r.stdout and "evictions" in r.stdout


def test_chat_keeps_history_and_hits_the_prefix_cache():
    r = kvos("chat", "--max-tokens", "16", "--stats",
             stdin="What is the capital of France?\nAnd of Italy?\n/stats\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    hits = [line for line in r.stdout.splitlines() if line.strip().startswith("prefix")]
    assert len(hits) >= 2
    assert not hits[-1].strip().startswith("prefix     0 of")  # the second turn reused the first


def test_bad_input_exits_with_a_clear_error():
    r = kvos("generate", "hi", "--max-tokens", "0")
    assert r.returncode == 2 and "max_tokens" in r.stderr
    r = kvos("generate", "hi", "--model", "/no/such/model.gguf")
    assert r.returncode == 2 and "model" in r.stderr
