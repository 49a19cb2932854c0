"""One source of configuration: every flag of serve, simulate, plan and bench that sets a field of
``EngineConfig``, ``RouterConfig`` or ``SimOptions`` has that field's default and choices; the
scheduler's config is built from ``EngineConfig``; and the policies' registries are the CLI's
choices, so a class added to a registry is selectable by name. Pure Python, parsed in-process."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvos.cache import FullAttentionSpec, KVCacheManager
from kvos.cache.eviction import EVICTION_POLICIES, LRUPolicy, online_policies, register_eviction_policy
from kvos.cli import build_parser
from kvos.config import EngineConfig
from kvos.config.flags import field_choices, field_default, field_dest
from kvos.core.request import Request
from kvos.core.sampling_params import SamplingParams
from kvos.router import ROUTERS, RouterConfig, register_router
from kvos.router.policies import Router
from kvos.scheduler.policies import (
    VICTIM_ORDERS,
    WAITING_POLICIES,
    VictimOrder,
    WaitingQueuePolicy,
    register_victim_order,
    register_waiting_policy,
)
from kvos.scheduler.scheduler import Scheduler, SchedulerConfig
from kvos.sim.cost_model import CostModel
from kvos.sim.fleet import FleetSimulator
from kvos.sim.hardware import GPUS
from kvos.sim.options import SimOptions
from kvos.sim.shapes import PRESETS
from kvos.sim.simulator import SimConfig, Simulator
from kvos.sim.traces import TraceRequest

CONFIGS = (EngineConfig, RouterConfig, SimOptions)
COMMANDS = [["serve"], ["generate", "hi"], ["simulate"], ["plan", "--model", "llama-3.1-8b"],
            *[["bench", name] for name in ("throughput", "sampling", "steps", "hybrid", "kv-speed", "fleet",
                                           "routing", "policies")]]
OWN_INPUTS = {"simulate": {"model"}, "plan": {"model"}, "bench routing": {"time_scale"}}
"""Flags that share a field's name but are a command's own input: the simulator's and the
planner's --model names a model's shape (a preset or config) for the cost model, not weights;
bench routing's --time-scale replaces the scale each fleet size derives from --load (default)."""
COST = CostModel.for_model(PRESETS["llama-3.1-8b"], GPUS["H100-80G"])


def subparser(command: list[str]) -> argparse.ArgumentParser:
    p = build_parser()
    for name in command:
        sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or name not in sub.choices:
            break
        p = sub.choices[name]
    return p


def config_fields_by_dest() -> dict[str, tuple[type, dataclasses.Field]]:
    out: dict[str, tuple[type, dataclasses.Field]] = {}
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            assert field_dest(f) not in out, f"{cls.__name__}.{f.name} shares a flag with {out[field_dest(f)]}"
            out[field_dest(f)] = (cls, f)
    return out


# -- (a) one default per setting ---------------------------------------------------------------

@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_config_flag_has_its_fields_default_and_choices(command):
    """A flag that sets a config field (by its namespace name) defaults to the field's default and
    offers the field's choices, whether generated or written by hand."""
    fields = config_fields_by_dest()
    own = OWN_INPUTS.get(" ".join(command[:2] if command[0] == "bench" else command[:1]), set())
    checked = 0
    for action in subparser(command)._actions:
        if action.dest not in fields or not action.option_strings or action.dest in own:
            continue
        cls, f = fields[action.dest]
        assert action.default == field_default(cls, f), (command, action.option_strings, cls.__name__)
        want = field_choices(f)
        if want is not None:
            if command == ["simulate"] and f.name == "eviction_policy":  # the simulator adds the offline optimum
                want = list(EVICTION_POLICIES)
            assert list(action.choices) == want, (command, action.option_strings)
        checked += 1
    assert checked, f"{command}: no flag of a config field"


@pytest.mark.parametrize("command, cls", [(["serve"], RouterConfig), (["simulate"], RouterConfig),
                                          (["simulate"], SimOptions)], ids=str)
def test_no_flags_give_the_dataclass_defaults(command, cls):
    a = build_parser().parse_args(command)
    assert cls(**{f.name: getattr(a, field_dest(f)) for f in dataclasses.fields(cls)}) == cls()


def test_simulator_engine_defaults_are_the_engines():
    a = build_parser().parse_args(["simulate"])
    engine = EngineConfig()
    for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "eviction_policy", "scheduling_policy"):
        assert getattr(a, name) == getattr(engine, name) == getattr(SimConfig(), name), name


def test_router_flags_parse_and_check():
    a = build_parser().parse_args(["serve", "--router", "approx", "--kv-weight", "2", "--router-balance", "5,3",
                                   "--router-queue-weight", "0.1", "--router-shared-balance", "4,1.5",
                                   "--router-shared-threshold", "6", "--router-sole-margin", "3"])
    config = RouterConfig(a.router, a.kv_weight, a.router_balance, a.router_queue_weight, a.router_shared_balance,
                          a.router_shared_threshold, a.router_sole_margin)
    assert config == RouterConfig("approx", 2.0, (5, 3.0), 0.1, (4, 1.5), 6, 3)
    router = config.build(3, 16, capacity_blocks=50)  # every setting reaches the router the fleet uses
    assert (router.overlap_weight, router.balance_abs, router.balance_rel, router.queue_weight, router.shared_balance,
            router.shared_threshold, router.sole_margin, router.capacity_blocks) == (2.0, 5, 3.0, 0.1, (4, 1.5), 6,
                                                                                     3, 50)
    assert RouterConfig("kv_aware", router_queue_weight=0.5).build(2).queue_weight == 0.5
    kv = RouterConfig("kv_aware", router_shared_balance=(3, 2.0), router_shared_threshold=2).build(2, capacity_blocks=9)
    assert (kv.shared_balance, kv.shared_threshold, kv.capacity_blocks) == ((3, 2.0), 2, 9)
    with pytest.raises(ValueError, match="router must be one of"):
        RouterConfig("random")
    with pytest.raises(ValueError, match="router_balance"):
        RouterConfig(router_balance=(-1, 2.0))
    with pytest.raises(ValueError, match="router_queue_weight"):
        RouterConfig(router_queue_weight=-0.5)
    with pytest.raises(ValueError, match="router_shared_balance: balance_rel must be 0"):
        RouterConfig(router_shared_balance=(8, 0.5))
    with pytest.raises(ValueError, match="router_shared_threshold must be >= 0"):
        RouterConfig(router_shared_threshold=-1)
    with pytest.raises(ValueError, match="router_sole_margin must be >= 0"):
        RouterConfig(router_sole_margin=-1)
    with pytest.raises(SystemExit):  # argparse: the flag's own check
        build_parser().parse_args(["serve", "--router-shared-balance", "8"])


# -- (b) the scheduler's config comes from EngineConfig ----------------------------------------

def test_scheduler_config_carries_the_engine_configs_values():
    engine = EngineConfig(max_num_batched_tokens=512, max_num_seqs=8, scheduling_policy="lpm",
                          preemption_order="least_progress", fairness_steps=5, eviction_lookahead=3)
    assert engine.scheduler_config() == SchedulerConfig(512, 8, "lpm", "least_progress", 5, 3)
    for f in dataclasses.fields(SchedulerConfig):  # same names, same defaults: one source
        assert getattr(EngineConfig(), f.name) == f.default, f.name
    sim = SimConfig.of(max_num_seqs=4, eviction_policy="belady", eviction_lookahead=9)
    assert sim.scheduler_config() == SchedulerConfig(2048, 4, "fcfs", "latest", 64, 0)  # the optimum needs none


@pytest.mark.parametrize("field, value", [("max_num_seqs", 0), ("fairness_steps", 0), ("eviction_lookahead", -1),
                                          ("scheduling_policy", "sjf"), ("preemption_order", "oldest")])
def test_scheduler_fields_are_checked_once_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


# -- (c) registries are the choices; a registered class is selectable --------------------------

def choices(command: list[str], flag: str) -> list[str]:
    return next(list(a.choices) for a in subparser(command)._actions if flag in a.option_strings)


def test_registries_are_the_cli_choices():
    for command in (["serve"], ["simulate"]):
        assert choices(command, "--scheduling-policy") == list(WAITING_POLICIES) == ["fcfs", "priority", "lpm"]
        assert choices(command, "--preemption-order") == list(VICTIM_ORDERS) == ["latest", "least_progress"]
        assert choices(command, "--router") == list(ROUTERS)
    assert choices(["serve"], "--eviction-policy") == list(online_policies())
    assert choices(["simulate"], "--eviction-policy") == list(EVICTION_POLICIES)
    assert "belady" in EVICTION_POLICIES and "belady" not in online_policies()


@pytest.fixture
def registered():
    """Classes a test registers, taken out of their registries afterwards."""
    added: list[tuple[dict, str]] = []

    def add(registry: dict, register, cls):
        register(cls)
        added.append((registry, cls.name))
        return cls

    yield add
    for registry, name in added:
        registry.pop(name, None)


def step_admitted(sched: Scheduler) -> list[str]:
    out = sched.schedule()
    sched.update_from_output(out, {t.request_id: 7 for s in out.seqs for t in s.samplers})
    return [s.request.request_id for s in out.seqs if s.start < s.request.num_prompt_tokens]


def test_a_registered_waiting_policy_is_selectable_and_used(registered):
    class NewestFirst(WaitingQueuePolicy):
        name = "newest_first"

        def key(self, req: Request) -> tuple:
            return (0, -req.arrival, req.sample_index)

    registered(WAITING_POLICIES, register_waiting_policy, NewestFirst)
    assert "newest_first" in choices(["serve"], "--scheduling-policy")
    config = EngineConfig(scheduling_policy="newest_first", max_num_seqs=1).scheduler_config()
    sched = Scheduler(config, KVCacheManager(FullAttentionSpec(4, 1, 1, 1), 64, "m"))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for rid in ("a", "b", "c"):
        sched.add_request(Request(rid, [1, 2, 3, 4, 5], params))
    assert [step_admitted(sched) for _ in range(3)] == [["c"], ["b"], ["a"]]


def test_a_registered_victim_order_is_selectable_and_used(registered):
    class EarliestFirst(VictimOrder):
        name = "earliest"

        def key(self, req: Request) -> tuple:
            return (-req.arrival,)

    registered(VICTIM_ORDERS, register_victim_order, EarliestFirst)
    assert "earliest" in choices(["simulate"], "--preemption-order")
    preempted = {}
    for order in ("latest", "earliest"):
        # 5 usable blocks of 4 tokens: two 7-token prompts (2 blocks each) grow until one must go
        sched = Scheduler(EngineConfig(preemption_order=order).scheduler_config(),
                          KVCacheManager(FullAttentionSpec(4, 1, 1, 1), 6, "m", enable_caching=False))
        for rid in ("first", "second"):
            sched.add_request(Request(rid, list(range(7)), SamplingParams(max_tokens=8, ignore_eos=True)))
        while sched.has_unfinished() and order not in preempted:
            out = sched.schedule()
            if out.preempted:
                preempted[order] = out.preempted[0].request_id
            sched.update_from_output(out, {t.request_id: 7 for s in out.seqs for t in s.samplers})
    assert preempted == {"latest": "second", "earliest": "first"}


def test_a_registered_eviction_policy_is_selectable_and_used(registered):
    popped: list[int] = []

    class CountingLRU(LRUPolicy):
        name = "counting_lru"

        def pop(self):
            block = super().pop()
            popped.append(block.block_id)
            return block

    registered(EVICTION_POLICIES, register_eviction_policy, CountingLRU)
    assert "counting_lru" in choices(["serve"], "--eviction-policy") and EngineConfig(eviction_policy="counting_lru")
    KVCacheManager(FullAttentionSpec(4, 1, 1, 1), 8, "m", policy="counting_lru")  # by name, as the engine does
    trace = [TraceRequest(float(i), 64, 2) for i in range(6)]  # distinct prompts: every one evicts
    report = Simulator(trace, SimConfig.of(num_blocks=10, eviction_policy="counting_lru"), COST).run()
    assert report["evictions"] == len(popped) > 0


def test_a_registered_router_is_selectable_and_used(registered):
    class FirstLive(Router):
        name = "first_live"
        needs_loads = False

        def choose(self, request_hashes, loads) -> int:
            return self._live()[0]

    registered(ROUTERS, register_router, FirstLive)
    assert "first_live" in choices(["serve"], "--router") and "first_live" in choices(["simulate"], "--router")
    a = build_parser().parse_args(["simulate", "--router", "first_live"])
    trace = [TraceRequest(i * 0.1, 64, 2) for i in range(8)]
    report = FleetSimulator(trace, SimConfig.of(num_blocks=64), COST, 3, RouterConfig(a.router)).run()
    assert report["router"] == "first_live" and report["requests_per_engine"] == [8, 0, 0]
