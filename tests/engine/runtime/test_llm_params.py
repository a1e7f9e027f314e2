"""The offline API refuses settings that cannot work together before anything is submitted, as
the server answers them with a 400."""

from __future__ import annotations

import pytest

from deepinfer.engine.protocol import GrammarSpec, SamplingParams
from deepinfer.engine.runtime.llm import check_params


def test_ignore_eos_with_a_grammar_is_refused():
    grammar = GrammarSpec("regex", "[ab]+")
    with pytest.raises(ValueError, match="ignore_eos cannot be combined with structured output"):
        check_params(SamplingParams(grammar=grammar, ignore_eos=True))
    ok = SamplingParams(grammar=grammar)
    assert check_params(ok) is ok
    plain = SamplingParams(ignore_eos=True)
    assert check_params(plain) is plain
