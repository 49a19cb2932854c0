"""The ``kvos`` command as a user runs it (real subprocesses)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from kvos.cli import build_parser
from kvos.config import EngineConfig
from kvos.config.flags import engine_kwargs, field_choices, field_flags

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


@pytest.mark.parametrize("argv, flag, why", [
    (["plan", "--model", "llama-3.1-8b", "--gpu-bandwidth-tbs", "0"], "--gpu-bandwidth-tbs", "must be positive"),
    (["plan", "--model", "llama-3.1-8b", "--output-len", "-200"], "--output-len", "must be >= 0"),
    (["simulate", "--synthetic", "--rate", "0"], "--rate", "must be positive"),
    (["simulate", "--synthetic", "--turns", "0"], "--turns", "must be positive"),
    (["simulate", "--synthetic", "--num-requests", "-5"], "--num-requests", "must be positive"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("--") else None)
def test_workload_and_hardware_numbers_are_checked_at_the_flag(argv, flag, why, capsys):
    """Values that divided by zero or printed negative sizes deep in the planner and simulator."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and f"argument {flag}: {why}" in capsys.readouterr().err


# The engine flags, generated from EngineConfig's fields (parsed in-process, nothing runs).

ENGINE_COMMANDS = [["serve"], ["generate", "hi"], ["chat"], ["bench", "throughput"], ["bench", "steps"],
                   ["bench", "hybrid"], ["bench", "kv-speed"]]


def engine_config(*argv: str) -> tuple[EngineConfig, object]:
    a = build_parser().parse_args(list(argv))
    return EngineConfig(**engine_kwargs(a)), a


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=" ".join)
def test_no_engine_flags_give_the_dataclass_defaults(command):
    a = build_parser().parse_args(command)
    kw = engine_kwargs(a)
    assert list(kw) == [f.name for f in dataclasses.fields(EngineConfig)]
    assert dataclasses.asdict(EngineConfig(**kw)) == dataclasses.asdict(EngineConfig())


def other_value(f: dataclasses.Field) -> tuple[list[str], object]:
    """Flags that set ``f`` to a value other than its default, and that value."""
    flag, default, choices = field_flags(f)[0], f.default, field_choices(f)
    if choices:
        value = next(c for c in choices if c != default)
        return [flag, value], value
    if f.name == "async_scheduling":
        return [flag, "on"], True
    if isinstance(default, bool):
        return [flag], not default
    if isinstance(default, float):
        return [flag, "0.25"], 0.25
    if isinstance(default, int) or f.name in ("kv_cache_memory_bytes", "num_blocks", "max_model_len",
                                              "mamba_cache_every"):
        value = (default or 3) + 1
        return [flag, str(value)], value
    return [flag, "x"], "x"


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"]], ids=" ".join)
def test_every_engine_config_field_has_a_flag(command):
    """A field added to EngineConfig fails here until it reaches the CLI with its own value."""
    for f in dataclasses.fields(EngineConfig):
        flags, value = other_value(f)
        assert value != f.default, f.name
        kw = engine_kwargs(build_parser().parse_args(command + flags))
        assert kw[f.name] == value, (f.name, flags)
        assert {k: v for k, v in kw.items() if k != f.name} == {
            k: v for k, v in dataclasses.asdict(EngineConfig()).items() if k != f.name}, f.name


def test_new_engine_flags_round_trip():
    cfg, _ = engine_config("serve", "--scheduling-policy", "lpm", "--eviction-policy", "arc", "--fairness-steps", "8",
                           "--no-prefix-caching", "--async-scheduling", "off", "--preemption-order", "least_progress",
                           "--max-pinned-fraction", "0.25", "--engine-seed", "7")
    assert (cfg.scheduling_policy, cfg.eviction_policy, cfg.fairness_steps, cfg.enable_prefix_caching,
            cfg.async_scheduling, cfg.preemption_order, cfg.max_pinned_fraction, cfg.seed) == (
        "lpm", "arc", 8, False, False, "least_progress", 0.25, 7)
    assert engine_config("serve", "--async-scheduling", "on")[0].async_scheduling is True


def test_engine_seed_and_sampling_seed_are_separate():
    cfg, a = engine_config("generate", "hi", "--seed", "5", "--engine-seed", "9")
    assert cfg.seed == 9 and a.seed == 5
    cfg, a = engine_config("generate", "hi")
    assert cfg.seed == EngineConfig().seed and a.seed is None


def test_existing_engine_flag_spellings_still_work():
    cfg, _ = engine_config(
        "generate", "hi", "--model", "m.gguf", "--random-weights", "--block-size", "32", "--kv-layout", "equal_pages",
        "--no-prefix-caching", "--kv-cache-memory-bytes", "1000000", "--gpu-memory-utilization", "0.5",
        "--enforce-eager", "--async-scheduling", "on", "--num-blocks", "64", "--max-num-batched-tokens", "512",
        "--max-num-seqs", "8", "--max-model-len", "4096", "--dtype", "float16", "--kv-cache-dtype", "int8",
        "--device", "cuda:1", "--cpu-cache-gb", "1.5", "--disk-cache-dir", "/tmp/kv", "--disk-cache-gb", "2",
        "--remote-cache", "redis://h:1", "--write-policy", "write_back", "--preemption-mode", "swap",
        "--swap-space-gb", "3")
    assert dataclasses.asdict(cfg) == dataclasses.asdict(EngineConfig(
        model="m.gguf", random_weights=True, block_size=32, kv_layout="equal_pages", enable_prefix_caching=False,
        kv_cache_memory_bytes=1000000, gpu_memory_utilization=0.5, enforce_eager=True, async_scheduling=True,
        num_blocks=64, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096, dtype="float16",
        kv_cache_dtype="int8", device="cuda:1", cpu_cache_gb=1.5, disk_cache_dir="/tmp/kv", disk_cache_gb=2.0,
        remote_cache="redis://h:1", write_policy="write_back", preemption_mode="swap", swap_space_gb=3.0))
    assert engine_config("serve", "--config", "llama-tiny")[0].model == "llama-tiny"


@pytest.mark.parametrize("flags", [["--eviction-policy", "nope"], ["--async-scheduling", "maybe"],
                                   ["--kv-layout", "nope"], ["--fairness-steps", "many"]])
def test_bad_engine_flag_value_is_an_argparse_error(flags, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[0]}:" in err and ("invalid choice" in err or "invalid int value" in err)
