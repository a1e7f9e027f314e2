"""Structured output in the engine under pressure: preemption (recompute) and speculation with
the default model. The grammar matcher lives beside the request's sampling state on the worker,
which survives a preemption, so a recomputed request continues its grammar where it was."""

from __future__ import annotations

import json

import jsonschema

from deepinfer.engine.protocol import GrammarSpec, SamplingParams
from deepinfer.engine.runtime.llm import LLM
from scripts.structured_schemas import SCHEMAS

PICK = [SCHEMAS[i] for i in (0, 2, 9, 11, 14, 17)]


def params(schema: dict) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=0.0,
                          grammar=GrammarSpec("json_schema", json.dumps(schema)))


def run(default_model, **engine) -> tuple[list[str], object]:
    prompts = [f"Here is {what}, as JSON: " for what, _ in PICK]
    with LLM(str(default_model), **engine) as llm:
        outs = llm.generate(prompts, [params(schema) for _, schema in PICK])
        return outs, llm.stats()


def test_preemption_and_speculation_keep_outputs_valid_and_unchanged(default_model):
    ref, _ = run(default_model, num_kv_blocks=256, block_size=16)
    # 10 blocks of 16 cannot hold six ~60-token sequences: requests are preempted mid-answer
    # and recomputed; n-gram drafts are checked against each grammar meanwhile.
    outs, stats = run(default_model, num_kv_blocks=10, block_size=16, max_num_seqs=6,
                      speculative_method="ngram", ngram_min=1)
    assert stats.num_preemptions > 0 and stats.spec_draft_tokens > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    for (_, schema), out, before in zip(PICK, outs, ref):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
        assert out.text == before.text
