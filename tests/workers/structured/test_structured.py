"""Structured output on the worker: the xgrammar backend, the compile service, grammar masks,
and exact rejection sampling under a grammar. A toy vocabulary keeps every mask readable."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tokenizers import Tokenizer

pytest.importorskip("xgrammar")
import xgrammar as xgr  # noqa: E402

from deepinfer.engine.protocol import GrammarSpec, SamplingParams  # noqa: E402
from deepinfer.workers.sample.rejection import Verification, verify  # noqa: E402
from deepinfer.workers.sample.sampler import Sampler, SamplingState  # noqa: E402
from deepinfer.workers.structured.compile_service import GrammarCompileService  # noqa: E402
from deepinfer.workers.structured.masks import (  # noqa: E402
    AfterMarker,
    MaskedRows,
    accept,
    allowed_drafts,
    fill_bitmask,
)
from deepinfer.workers.structured.xgrammar_backend import GrammarError, XGrammarBackend  # noqa: E402
from tests.workers.sample.test_rejection import chi_square_p  # noqa: E402

SMOL_EOS = 2  # the default model's <|im_end|>
VOCAB = ["a", "b", "c", "d", "e", "{", "}", "</s>"]
EOS = 7
V = len(VOCAB)


@pytest.fixture(scope="module")
def backend() -> XGrammarBackend:
    return XGrammarBackend(xgr.TokenizerInfo(VOCAB, vocab_size=V, stop_token_ids=[EOS]))


def allowed(backend, matcher) -> set[int]:
    bitmask = backend.allocate(1)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, V)
    backend.apply(logits, bitmask, [0])
    return {i for i in range(V) if logits[0, i] > float("-inf")}


def test_masks_follow_the_grammar_and_eos_only_where_it_can_end(backend):
    m = backend.matcher(backend.compile(GrammarSpec("regex", "[ab]c+")))
    assert allowed(backend, m) == {0, 1}
    accept(m, [1])
    assert allowed(backend, m) == {2}  # no EOS before the grammar can end
    accept(m, [2])
    assert allowed(backend, m) == {2, EOS}
    accept(m, [EOS])
    assert m.is_terminated()


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", '{"type": "foo"}'), 'invalid JSON schema: Unsupported type "foo"'),
    (GrammarSpec("json_schema", "{not json"), "invalid JSON schema: Failed to parse JSON"),
    (GrammarSpec("json_schema", '{"$ref": "#/$defs/x"}'), "invalid JSON schema: Cannot find"),
    (GrammarSpec("regex", "(ab"), "invalid regex: Regex parsing error at position 4"),
    (GrammarSpec("ebnf", "root ::= foo"), 'invalid EBNF grammar: EBNF parser error at line 1, '
                                          'column 10: Rule "foo" is not defined'),
])
def test_bad_grammars_are_refused_with_a_clean_message(backend, spec, message):
    with pytest.raises(GrammarError) as err:
        backend.compile(spec)
    assert str(err.value).startswith(message)
    assert ".cc:" not in str(err.value)  # no C++ source locations for users


@pytest.fixture(scope="module")
def smol(default_model) -> tuple[XGrammarBackend, Tokenizer]:
    """The backend over the default model's real vocabulary, and its tokenizer."""
    return (XGrammarBackend.for_model(str(default_model), 49152, [SMOL_EOS]),
            Tokenizer.from_file(str(default_model / "tokenizer.json")))


def test_json_object_means_an_object_at_the_top_level(smol):
    """OpenAI's JSON mode: the default model had answered [1, 2, 3, 4, 5] under it."""
    backend, tok = smol
    compiled = backend.compile(GrammarSpec("json_object"))

    def accepts(text: str) -> bool:  # the whole text, then the end
        m = backend.matcher(compiled)
        return m.accept_string(text) and m.accept_token(SMOL_EOS) and m.is_terminated()

    m = backend.matcher(compiled)
    bitmask = backend.allocate(1)
    m.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, backend.vocab_size)
    backend.apply(logits, bitmask, [0])
    first = [tok.decode([i]) for i in torch.nonzero(logits[0] > float("-inf")).flatten().tolist()]
    assert first and all(text.startswith("{") for text in first), first
    for text in ("[1, 2, 3, 4, 5]", "[]", '"text"', "42", "null"):
        assert not accepts(text), text
    for text in ("{}", '{"numbers": [1, 2, 3], "nested": {"ok": true, "none": null}}'):
        assert accepts(text), text
    # Compact, as the json_schema path: small models otherwise pad with endless newlines.
    assert not accepts('{\n  "a": 1\n}')


def test_allowed_drafts_cut_at_the_first_refused(backend):
    m = backend.matcher(backend.compile(GrammarSpec("regex", "abc")))
    assert allowed_drafts(m, [0, 1, 0, 2], keep_refused=False) == [0, 1]
    assert allowed_drafts(m, [0, 1, 0, 2], keep_refused=True) == [0, 1, 0]
    assert allowed_drafts(m, [0, 1, 2], keep_refused=True) == [0, 1, 2]
    assert allowed(backend, m) == {0}  # rolled back: the matcher has accepted nothing


def test_fill_bitmask_masks_each_draft_row_with_the_drafts_before_it(backend):
    m = backend.matcher(backend.compile(GrammarSpec("regex", "abc")))
    other = backend.matcher(backend.compile(GrammarSpec("regex", "[de]+")))
    bitmask, rows = fill_bitmask(backend, [MaskedRows(m, [0, 1], 1),
                                           MaskedRows(other, [], 5)], 6)
    assert rows == [1, 2, 3, 5]
    logits = torch.zeros(6, V)
    backend.apply(logits, bitmask, rows)
    free = [{i for i in range(V) if logits[r, i] > float("-inf")} for r in range(6)]
    assert free[1] == {0} and free[2] == {1} and free[3] == {2} and free[5] == {3, 4}
    assert free[0] == free[4] == set(range(V))  # unconstrained rows untouched
    assert allowed(backend, m) == {0}  # rolled back after filling


def test_a_refused_draft_gets_its_row_and_no_rows_after_it(backend):
    m = backend.matcher(backend.compile(GrammarSpec("regex", "abc")))
    _, rows = fill_bitmask(backend, [MaskedRows(m, [0, 4, 2], 0)], 4)
    assert rows == [0, 1]  # row 1 refuses draft 4 for sure; rows after it are never read


def test_terminated_matchers_are_left_alone(backend):
    m = backend.matcher(backend.compile(GrammarSpec("regex", "a")))
    accept(m, [0, EOS])
    assert m.is_terminated()
    _, rows = fill_bitmask(backend, [MaskedRows(m, [], 0)], 1)
    assert rows == []  # an overlap step past the end: its token is discarded anyway


def test_greedy_verification_under_a_grammar(backend):
    """The target prefers 'd' everywhere; the grammar forces a, b, c: drafts a, b are kept,
    and the bonus is c."""
    m = backend.matcher(backend.compile(GrammarSpec("regex", "abc")))
    logits = torch.zeros(3, V)
    logits[:, 3] = 10.0
    bitmask, rows = fill_bitmask(backend, [MaskedRows(m, [0, 1], 0)], 3)
    backend.apply(logits, bitmask, rows)
    s = SamplingState.create(SamplingParams(temperature=0.0), torch.tensor([1]))
    (tokens, _), = verify(Sampler(0), logits, [Verification(s, [0, 1], None, 0)])
    assert tokens == [0, 1, 2]


def test_rejection_sampling_under_a_grammar_is_exact(backend):
    """Drafts sampled from an unconstrained q (often outside the grammar) against a target
    masked by the grammar: the emitted tokens follow the masked target exactly."""
    compiled = backend.compile(GrammarSpec("regex", "[abc][de]"))
    p = torch.tensor([0.10, 0.25, 0.05, 0.20, 0.10, 0.15, 0.05, 0.10])
    q = torch.tensor([[0.05, 0.05, 0.30, 0.20, 0.10, 0.10, 0.10, 0.10],
                      [0.10, 0.10, 0.10, 0.40, 0.05, 0.05, 0.10, 0.10]])
    gen = torch.Generator().manual_seed(3)
    sampler = Sampler(11)
    first, second = torch.zeros(V), torch.zeros(V)
    batch = 500
    for _ in range(16):
        seqs, masked_rows = [], []
        for i in range(batch):
            m = backend.matcher(compiled)
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
            drafts = allowed_drafts(m, drafts, keep_refused=True)
            seqs.append((m, drafts))
            masked_rows.append(MaskedRows(m, drafts, i * 3))
        logits = p.log().repeat(batch * 3, 1)
        bitmask, rows = fill_bitmask(backend, masked_rows, batch * 3)
        backend.apply(logits, bitmask, rows)
        states = [SamplingState.create(SamplingParams(temperature=1.0), torch.tensor([1]))
                  for _ in range(batch)]
        out = verify(sampler, logits, [Verification(st, d, q[: len(d)], i * 3)
                                       for i, (st, (_, d)) in enumerate(zip(states, seqs))])
        for (m, _), (tokens, _) in zip(seqs, out):
            accept(m, tokens)
            first[tokens[0]] += 1
            if len(tokens) > 1:
                second[tokens[1]] += 1
    target_first = torch.zeros(V)
    target_first[:3] = p[:3] / p[:3].sum()
    target_second = torch.zeros(V)
    target_second[3:5] = p[3:5] / p[3:5].sum()
    assert chi_square_p(first, target_first) > 1e-3
    assert chi_square_p(second, target_second) > 1e-3
    assert second.sum() > 1000  # drafts were accepted often enough to test the second row


class SlowBackend:
    """A fake backend: `compile` returns the spec's text after `delay` seconds."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls = 0

    def compile(self, spec: GrammarSpec) -> str:
        self.calls += 1
        time.sleep(self.delay)
        if spec.kind == "bad":
            raise GrammarError("invalid regex: nope")
        return spec.spec


def answers(service: GrammarCompileService, jobs: list[tuple[str, GrammarSpec]]
            ) -> dict[str, str | None]:
    got: dict[str, str | None] = {}
    done = threading.Event()

    def on_ready(rid: str, error: str | None) -> None:
        got[rid] = error
        if len(got) == len(jobs):
            done.set()

    for rid, spec in jobs:
        service.submit(rid, spec, on_ready)
    assert done.wait(10)
    return got


def test_compile_service_caches_by_spec_and_shares_compiles():
    backend = SlowBackend(0.05)
    service = GrammarCompileService(lambda: backend, timeout_s=5)
    spec = GrammarSpec("regex", "x")
    got = answers(service, [(f"r{i}", spec) for i in range(5)])
    assert got == {f"r{i}": None for i in range(5)}
    assert backend.calls == 1  # one compile for five requests
    assert service.take("r3", spec) == "x"
    answers(service, [("later", GrammarSpec("regex", "x"))])
    assert backend.calls == 1  # cached
    answers(service, [("other", GrammarSpec("regex", "y"))])
    assert backend.calls == 2


def test_compile_service_reports_errors_once():
    service = GrammarCompileService(lambda: SlowBackend(), timeout_s=5)
    assert answers(service, [("r", GrammarSpec("bad", "?"))]) == {"r": "invalid regex: nope"}


def test_compile_service_times_out():
    backend = SlowBackend(1.0)
    service = GrammarCompileService(lambda: backend, timeout_s=0.1)
    got = answers(service, [("r", GrammarSpec("regex", "slow"))])
    assert got == {"r": "grammar compilation took longer than 0.1 s"}
    time.sleep(1.1)  # the compile ends later: no second answer, and it is cached for others
    assert answers(service, [("s", GrammarSpec("regex", "slow"))]) == {"s": None}


# --- a grammar that starts after the reasoning ------------------------------------------------

MARK = [3, 4]  # "d", "e": the toy vocabulary's `</think>`


def after_marker(backend, regex: str) -> AfterMarker:
    return AfterMarker(backend.matcher(backend.compile(GrammarSpec("regex", regex))), MARK)


def test_the_grammar_starts_after_the_marker(backend):
    m = after_marker(backend, "ab")
    assert allowed(backend, m) == set(range(V))  # reasoning: anything
    for token in [2, 0, 3]:  # "c", "a", then half of the marker: still free
        assert m.accept_token(token)
        assert allowed(backend, m) == set(range(V))
    assert m.accept_token(4)  # the marker is complete: the grammar rules from here
    assert allowed(backend, m) == {0}
    assert m.accept_token(0) and not m.accept_token(0)
    assert allowed(backend, m) == {1}
    assert m.accept_token(1) and m.accept_token(EOS) and m.is_terminated()


def test_rollback_across_the_marker(backend):
    """Drafts are checked and rolled back: a rollback over the marker's end frees the output
    again, and moving forward anew gives the same masks."""
    m = after_marker(backend, "ab")
    for token in [2, 3, 4, 0]:
        assert m.accept_token(token)
    m.rollback(2)  # "a" and the marker's last token
    assert not m.started and allowed(backend, m) == set(range(V))
    assert m.accept_token(4) and allowed(backend, m) == {0}
    assert m.accept_token(0) and allowed(backend, m) == {1}
    assert allowed_drafts(m, [1, 1], keep_refused=False) == [1]
    assert allowed(backend, m) == {1}  # allowed_drafts rolled back what it tried


OPENER = 2  # "c": the toy vocabulary's `<think>`


def test_optional_reasoning_the_first_token_decides(backend):
    """A model that may answer without thinking (Qwen3): the first token is the grammar's or
    the opener; without the opener the grammar rules from the first token (it used to wait for
    a marker that never came, and the answer went unconstrained)."""
    grammar = backend.compile(GrammarSpec("regex", "ab"))
    m = AfterMarker(backend.matcher(grammar), MARK, OPENER)
    assert allowed(backend, m) == {0, OPENER}
    assert m.accept_token(0) and allowed(backend, m) == {1}  # answered at once: constrained
    m.rollback(1)
    assert allowed(backend, m) == {0, OPENER}  # back at the start: undecided again
    assert not m.accept_token(1)  # a refused first draft decides nothing
    assert allowed(backend, m) == {0, OPENER}
    assert m.accept_token(OPENER) and allowed(backend, m) == set(range(V))  # thinking: free
    for token in [0, 1, 3, 4]:  # anything, then the marker
        assert m.accept_token(token)
    assert allowed(backend, m) == {0}
    m.rollback(5)
    assert allowed(backend, m) == {0, OPENER}
    assert allowed_drafts(m, [0, 1], keep_refused=False) == [0, 1]
    assert allowed(backend, m) == {0, OPENER}


def test_the_backend_encodes_the_marker_with_its_tokenizer(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from scripts.scripted_model import save_scripted_model

    model = save_scripted_model(tmp_path / "m", "<think>x</think>y", ("<think>", "</think>"))
    b = XGrammarBackend.for_model(str(model), 49152 + 64, [SMOL_EOS])
    m = b.matcher(b.compile(GrammarSpec("regex", "y")), after="</think>")
    think_end = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json")).encode(
        "</think>", add_special_tokens=False)
    assert isinstance(m, AfterMarker) and m.marker == think_end and len(think_end) == 1
    assert m.opener is None
    m = b.matcher(b.compile(GrammarSpec("regex", "y")), "</think>", opened_by="<think>")
    think = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json")).encode(
        "<think>", add_special_tokens=False)
    assert len(think) == 1 and m.opener == think[0]
