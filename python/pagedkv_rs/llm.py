"""vLLM-shaped offline API: ``LLM(model=...).generate(prompts, SamplingParams)`` and ``.chat(...)``.

``LLM`` loads a Llama-architecture GGUF (default: the bundled SmolLM2-135M-Instruct), builds the
tokenizer from its metadata, and runs requests through ``LLMEngine``: continuous batching over the
paged KV cache, one ``write_kv`` + one varlen ``paged_attention`` per layer and step.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

from pagedkv_rs.engine import LLMEngine, RequestStream
from pagedkv_rs.engine.pooling import EmbeddingRequestOutput, PoolingParams
from pagedkv_rs.engine.request import RequestOutput, SamplingParams
from pagedkv_rs.models.gguf_loader import GGUFFile, load_gguf
from pagedkv_rs.models.llama import LlamaModel, LlamaWeights, act_digits_choice, eos_ids_from_metadata
from pagedkv_rs.models.tokenizer import GGUFTokenizer
from pagedkv_rs.models.tool_calls import RESERVED_TEMPLATE_VARS, chat_messages
from pagedkv_rs.units import parse_memory

# The `model` extra, checked here so that its absence is named; found, not imported (each is imported
# where it is used: importing gguf alone is a noticeable part of the start-up).
for _extra in ("gguf", "jinja2", "tokenizers"):
    if importlib.util.find_spec(_extra) is None:
        raise ImportError(
            f'pagedkv_rs.LLM needs the "model" extra ({_extra} is missing): pip install "pagedkv-rs[model]"',
            name=_extra,
        )

__all__ = ["LLM", "SamplingParams", "PoolingParams", "RequestOutput", "EmbeddingRequestOutput", "parse_memory"]

DEFAULT_KV_MEMORY = 512 << 20  # bytes of KV cache when neither num_blocks nor kv_memory is given

Prompt = Union[str, Sequence[int]]
Conversation = Sequence[Mapping[str, Any]]


class _TextDecoder:
    """The tokenizer as the engine sees it: output text without special tokens (as vLLM does)."""

    def __init__(self, tok: GGUFTokenizer):
        self._tok = tok
        self.gguf = tok  # the vocabulary itself (structured outputs build llguidance's tokenizer from it)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def min_num_tokens(self, text: str) -> int:
        return self._tok.min_num_tokens(text)

    def decode(self, ids: Sequence[int]) -> str:
        # generated ids continue their prompt: a SentencePiece piece keeps its leading space (" Paris")
        return self._tok.decode(ids, skip_special_tokens=True, continuation=True)


class LLM:
    """An offline engine over one GGUF model.

    ``model``: path of a Llama-architecture GGUF file (or one opened by ``load_gguf``), or ``None`` for
    the bundled SmolLM2-135M.
    ``kv_dtype``: "float16" (default), "float32" or "bfloat16". The KV pool is ``num_blocks`` blocks
    of ``block_size`` tokens, or as many as fit in ``kv_memory`` (bytes or "512MiB"; default 512 MiB).
    ``weights``: "auto" (default: int8 blocks where the AVX-512 VNNI kernel runs, else float32),
    "int8" or "float32" (see ``pagedkv_rs.models.llama.LlamaWeights``).
    ``model_impl``: "auto" (default: the fused Rust decoder when the weights allow it), "fused" (with
    ``weights="auto"``: int8) or "numpy" (see ``pagedkv_rs.models.llama.LlamaModel``).
    ``act_digits``: int8 weights' activation digits, over the architecture's measured choice: 1 or 2 for every
    matrix, or per matrix as ``"head=1,wdown=2"`` / ``{"head": 1}`` (keys: head, wqkv, wo, wgu, wdown, ROLE.I).
    One digit (llama.cpp's Q8 activations) halves the multiply-adds of batched decode and prefill; two keep the
    logits within ~0.01 of float32 activations. ``pagedkv perplexity --kl-divergence --choose-act-digits`` measures
    the choice for a file (docs/models.md).
    ``tokenizer``: this model's ``GGUFTokenizer`` when the caller already built one (default: built here).
    ``kv_tiers``: KV tiers below the pool, in lookup order (``["disk:/var/cache/pagedkv?size=8GiB",
    "redis://127.0.0.1:6379/0"]``, see ``pagedkv_rs.tiers``); ``kv_tier_secret`` MACs their entries.
    ``backend``: allocator backend, "auto" | "rust" | "python". Other keyword arguments go to the
    scheduler (``max_num_seqs``, ``max_num_batched_tokens``, ``enable_chunked_prefill``,
    ``preemption_mode``, ``policy``, ``speculative="ngram[:k=K,n=N]"`` or ``"draft:PATH[:k=K]"``: speculative
    decoding, see the docs...).
    """

    def __init__(
        self,
        model: Union[str, GGUFFile, None] = None,
        *,
        kv_dtype: str = "float16",
        num_blocks: Optional[int] = None,
        kv_memory: Union[int, str, None] = None,
        block_size: int = 16,
        backend: str = "auto",
        weights: str = "auto",
        model_impl: str = "auto",
        act_digits: Union[int, str, Mapping[str, int], None] = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        tokenizer: Optional[GGUFTokenizer] = None,
        kv_tiers: Optional[Sequence[str]] = None,
        kv_tier_secret: Optional[Union[str, bytes]] = None,
        **scheduler_kwargs: Any,
    ) -> None:
        with _gc_paused():
            g = model if isinstance(model, GGUFFile) else load_gguf(model)
            self.model_path = g.path
            self.tokenizer = tokenizer if tokenizer is not None else GGUFTokenizer(g.metadata, path=g.path)
            if model_impl == "fused" and weights == "auto":
                weights = "int8"  # what the fused decoder runs
            # end-of-generation ids as llama.cpp marks them (<|eot_id|>, <end_of_turn>, <|im_end|>...) beside EOS
            eog = dict.fromkeys(
                [*eos_ids_from_metadata(g.metadata), *sorted(getattr(self.tokenizer, "eog_token_ids", ()))]
            )
            lw = LlamaWeights(g, weights=weights)
            if act_digits is not None:
                lw.set_act_digits(act_digits_choice(act_digits))
            self.model = LlamaModel(lw, eos_token_ids=tuple(eog), impl=model_impl)
        self.weight_format: str = self.model.weights.weight_format
        del g
        if num_blocks is not None and kv_memory is not None:
            raise ValueError("pass num_blocks or kv_memory, not both")
        if num_blocks is None:
            per_block = self.model.kv_bytes_per_block(block_size, kv_dtype)
            num_blocks = parse_memory(DEFAULT_KV_MEMORY if kv_memory is None else kv_memory) // per_block
            if num_blocks < 1:
                raise ValueError(f"kv_memory {kv_memory!r} holds no block: one block takes {per_block} bytes")
        self.kv_dtype = kv_dtype
        self.engine = LLMEngine(
            self.model,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_cache_dtype=kv_dtype,
            backend=backend,
            enable_prefix_caching=enable_prefix_caching,
            tokenizer=_TextDecoder(self.tokenizer),
            seed=seed,
            kv_tiers=kv_tiers,
            kv_tier_secret=kv_tier_secret,
            **scheduler_kwargs,
        )

    def get_tokenizer(self) -> GGUFTokenizer:
        """The GGUF tokenizer: ``encode``, ``decode``, ``apply_chat_template``."""
        return self.tokenizer

    def generate(
        self,
        prompts: Union[Prompt, Mapping[str, Any], Sequence[Union[Prompt, Mapping[str, Any]]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: Optional[bool] = None,
    ) -> list[RequestOutput]:
        """Complete raw prompts, batched continuously; outputs in prompt order.

        A prompt is text, a token-id list, or vLLM's dict ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``
        with an optional ``"cache_salt"`` (prefix-cache and KV-tier isolation between tenants).
        """
        return self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(
        self,
        prompts: Union[Prompt, Mapping[str, Any], Sequence[Union[Prompt, Mapping[str, Any]]]],
        pooling_params: Optional[PoolingParams] = None,
        *,
        pooling: str = "last",
        normalize: bool = True,
        use_tqdm: Optional[bool] = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed prompts (vLLM's ``LLM.embed``): each output's ``outputs.embedding`` is the hidden state after the
        final norm at the last token (``pooling="last"``) or averaged over the prompt (``"mean"``), L2-normalized
        unless ``normalize=False`` (``pooling_params`` instead: a ``PoolingParams``). Run by prefill only, batched
        with any generation under way."""
        params = pooling_params if pooling_params is not None else PoolingParams(pooling, normalize)
        return self.engine.generate(prompts, params, use_tqdm=use_tqdm)  # type: ignore[arg-type,return-value]

    def chat(
        self,
        messages: Union[Conversation, Sequence[Conversation]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: Optional[bool] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several (a list of such lists), as vLLM's ``LLM.chat``.

        ``tools``: OpenAI function tools, rendered by the GGUF's chat template (a template without tools gets the
        generic format in its system message); assistant ``tool_calls`` and ``role: "tool"`` messages render
        the same way. The output is the model's text: ``parse_tool_calls(text, tools, llm.tokenizer.chat_template)``
        (``pagedkv_rs.models.tool_calls``) finds its calls. ``continue_final_message``: the last (assistant)
        message is left open for the model to continue (then ``add_generation_prompt=False``).
        ``chat_template_kwargs``: more variables for the template (``{"enable_thinking": False}``).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        if continue_final_message:
            kwargs["continue_final_message"] = True
        prompts = []
        for conv in self._conversations(messages):
            msgs, shown = chat_messages(conv, tools, self.tokenizer.chat_template)
            extra = {**kwargs, "tools": shown} if shown is not None else kwargs
            prompts.append(self.tokenizer.apply_chat_template(msgs, add_generation_prompt, **extra))
        return self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> RequestStream:
        """Submit one request to the background loop; iterate the returned stream for incremental outputs."""
        return self.engine.submit(prompt, sampling_params)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the engine's loop and flush what the KV tiers still have to write."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @staticmethod
    def _conversations(messages: Any) -> list[Conversation]:
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
            return [messages]
        if (
            isinstance(messages, Sequence)
            and all(isinstance(c, Sequence) and c and all(isinstance(m, Mapping) for m in c) for c in messages)
            and messages
        ):
            return list(messages)
        raise ValueError("chat() takes a conversation (list of {'role', 'content'} dicts) or a list of them")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a model loads, then back as it was (also on an error).

    A load allocates ~100k container objects (the vocabulary and merge tables, the model's) that
    refcounting frees or that live as long as the model; the collections they set off walk them
    again and again (dozens of collections during one load).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
