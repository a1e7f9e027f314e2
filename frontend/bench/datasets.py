"""Prompts for the serving benchmark: random text, a shared prefix plus random suffixes, or
fixed input-grounded chat prompts (answers that copy the prompt, frontend/bench/grounded_prompts).

The random text is made of common English words, about one token each for BPE tokenizers, so no
tokenizer is needed on the client side; exact token counts come back in the server's usage.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from deepinfer.frontend.bench.grounded_prompts import GROUNDED_PROMPTS

WORDS = (
    "the of and to in is was for on that with as by at from his her are this be it an or had "
    "not but which have one were they all been their has more when there who will would can "
    "time year people city new first after two about also other into some these only most "
    "world state school water house small large music family during between under before "
    "since while where many those such through over later known could each three began "
    "early high part number name place work life game story light river north south east west "
    "team point power field party church court street road town village market garden "
    "island history system region station season member group level order book film album "
    "song player club county center summer winter spring autumn morning evening green blue "
    "red black white open close simple strong quick slow bright dark short long young old"
).split()


@dataclass
class BenchRequest:
    prompt: str
    input_words: int
    output_len: int
    # False when the answer has a natural end (input-grounded): it then stops at EOS, and
    # output_len is only a cap.
    ignore_eos: bool = True


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in = _length(rng, input_len, range_ratio)
        out.append(BenchRequest(_words(rng, n_in), n_in, _length(rng, output_len, range_ratio)))
    return out


def shared_prefix_requests(
    num: int, prefix_len: int, suffix_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """One random prefix (a long system prompt, say) shared by every prompt."""
    rng = random.Random(seed)
    prefix = _words(rng, prefix_len)
    out = []
    for _ in range(num):
        n_suffix = _length(rng, suffix_len, range_ratio)
        prompt = f"{prefix}\n{_words(rng, n_suffix)}"
        out.append(BenchRequest(prompt, prefix_len + n_suffix,
                                _length(rng, output_len, range_ratio)))
    return out


def input_grounded_requests(num: int, max_tokens: int) -> list[BenchRequest]:
    """The fixed input-grounded prompts in order (cycled when `num` exceeds them); EOS ends
    each answer, so its length is the model's own, up to `max_tokens`."""
    out = []
    for i in range(num):
        prompt = GROUNDED_PROMPTS[i % len(GROUNDED_PROMPTS)]
        out.append(BenchRequest(prompt, len(prompt.split()), max_tokens, ignore_eos=False))
    return out
