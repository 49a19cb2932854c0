"""Structured outputs on the real default model: every sampled output matches its JSON schema,
regex, choice or grammar (checked with ``jsonschema`` and ``re``, not with kvos), a free request in
the same batch keeps its tokens, and the mask itself matches a plain reference."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from kvos import SamplingParams
from kvos.core.structured_outputs import StructuredOutputsParams as SO
from kvos.worker.sampler import apply_allowed_masks

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 16},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}},
              "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["item", "qty", "express"],
         "properties": {"item": {"enum": ["apple", "pear", "plum"]}, "qty": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9},
                        "express": {"type": "boolean"}}}
ASK = [{"role": "user", "content": "Describe a person (name, age, pets, address) as JSON."}]
FREE = [{"role": "user", "content": "Name three colors."}]


def sample(llm, so, n=4, messages=ASK, max_tokens=120, **kw):
    params = SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=max_tokens, structured_outputs=so, **kw)
    return llm.chat([messages], params, use_tqdm=False)[0].outputs


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["nested", "enum"])
def test_sampled_json_always_validates(llm, schema):
    outs = sample(llm, SO(json=schema))
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_grammar_and_json_object(llm):
    for c in sample(llm, SO(regex=r"[A-Z][a-z]{2,8} [0-9]{2}"), max_tokens=20):
        assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", c.text), c.text
    choices = ["red", "green", "blue"]
    for c in sample(llm, SO(choice=choices), max_tokens=8):
        assert c.text in choices
    for c in sample(llm, SO(grammar='start: "x=" NUM (";" "x=" NUM)?\nNUM: /[0-9]{1,3}/'), max_tokens=20):
        assert re.fullmatch(r"x=[0-9]{1,3}(;x=[0-9]{1,3})?", c.text), c.text
    for c in sample(llm, SO(json_object=True), n=2, max_tokens=40):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert c.text.startswith("{")


def test_a_free_request_in_the_same_batch_keeps_its_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.chat([FREE], greedy, use_tqdm=False)[0].outputs[0]
    constrained = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=60, structured_outputs=SO(json=ORDER))
    both = llm.chat([FREE, ASK], [greedy, constrained], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone.token_ids
    for c in both[1].outputs:
        jsonschema.validate(json.loads(c.text), ORDER)


def test_greedy_constrained_output_is_the_unconstrained_one_when_it_fits(llm):
    """Where the model's own greedy reply already matches, the mask changes nothing."""
    free = llm.chat([FREE], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    pattern = re.escape(free.text) + ".*"
    c = llm.chat([FREE], SamplingParams(temperature=0, max_tokens=6, structured_outputs=SO(regex=pattern)),
                 use_tqdm=False)[0].outputs[0]
    assert c.token_ids == free.token_ids


def test_compiled_grammars_are_cached_and_bad_ones_name_the_field(llm):
    compiler = llm.engine.matchers.compiler
    sample(llm, SO(json=ORDER), n=1)
    hits = compiler.cache_hits
    sample(llm, SO(json=json.dumps(ORDER)), n=1)  # the same schema as text
    assert compiler.cache_hits > hits
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: .*foo"):
        llm.generate(["x"], SamplingParams(structured_outputs=SO(json={"type": "foo"})), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^guided_regex\.regex: "):
        llm.generate(["x"], SamplingParams(structured_outputs=SO(regex="[a-", field_name="guided_regex")),
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"^structured_outputs: set exactly one"):
        SO(regex="a", choice=["b"])
    deep = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    for schema in (deep, {"type": "string", "pattern": "\ud800"}):  # llguidance's own errors name the field too
        with pytest.raises(ValueError, match=r"^response_format\.json_schema\.json: "):
            spec = SO(json=schema, field_name="response_format.json_schema")
            llm.generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids  # still serves


def test_a_constraint_that_breaks_mid_generation_is_cut_not_stopped(llm):
    """llguidance compiles ``a{1000000}`` but its lexer gives up after a few tokens: the output so
    far does not match the constraint, so the sequence ends as ``abort`` with the reason, never
    as a plain ``stop``; a constraint that holds still ends as ``stop``."""
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=SO(regex="a{1000000}"))
    broken = llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0]
    assert broken.finish_reason == "abort" and len(broken.token_ids) < 12
    assert broken.stop_reason.startswith("structured_outputs: the constraint failed during generation (")
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=SO(regex="[a-z]{5}"))
    held = llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0]
    assert held.finish_reason == "stop" and held.stop_reason is None and len(held.text) == 5


def test_mask_matches_a_per_token_reference():
    g = torch.Generator().manual_seed(0)
    V = 100  # not a multiple of 32: the last word is partial
    logits = torch.randn(3, V, generator=g)
    allowed = [{0, 5, 31, 32, 63, 99}, set(range(40, 70)), {7}]
    words = np.zeros((2, 4), np.uint32)
    for i, a in enumerate((allowed[0], allowed[2])):
        for t in a:
            words[i, t // 32] |= np.uint32(1 << (t % 32))
    x = apply_allowed_masks(logits, ([0, 2], words.view(np.int32)))
    for row, a in ((0, allowed[0]), (2, allowed[2])):
        for t in range(V):
            assert (x[row, t] == logits[row, t]) if t in a else x[row, t] == float("-inf")
    assert torch.equal(x[1], logits[1])


def test_async_scheduling_drains_before_masking(make_llm):
    """With async scheduling a constrained sequence's mask must wait for its last token."""
    llm = make_llm(async_scheduling=True, kv_cache_memory_bytes=32 << 20)
    params = [SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=60, structured_outputs=SO(json=ORDER)),
              SamplingParams(temperature=0, max_tokens=12)]
    outs = llm.chat([ASK, FREE], params, use_tqdm=False)
    for c in outs[0].outputs:
        jsonschema.validate(json.loads(c.text), ORDER)
