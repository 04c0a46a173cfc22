"""#55 item 3: the demo's default settings do not loop on open-ended prompts (no 8-token
sequence three times in 256 tokens; greedy alone looped on 3 of these 5) and still answer the
factual questions right (>= 18 of 4 questions x 5 seeds). The prompts, questions and the loop
measure are benchmarks/repetition.py's; the demo file is made as `lucy demo` makes it."""

from __future__ import annotations

import re

import pytest

from benchmarks.repetition import FACTS, NGRAM, OPEN_PROMPTS, SEEDS, TIMES, max_ngram_count

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


@pytest.fixture(scope="module")
def demo(smollm2_gguf, tmp_path_factory):
    import entity
    from entity.smollm2 import DEMO_GENERATION
    from lucy.actions import DEMO_QUANT

    path = tmp_path_factory.mktemp("demo") / "demo.entity"
    entity.convert(smollm2_gguf, path, quant=DEMO_QUANT, generation=DEMO_GENERATION)
    return entity.load(path)


def test_max_ngram_count_against_a_plain_count():
    loop = [1, 2, 3, 4, 5, 6, 7, 8] * 3
    assert max_ngram_count(loop, 8) == 3 and max_ngram_count(list(range(30)), 8) == 1
    assert max_ngram_count([9] * 10, 8) == 3  # overlapping occurrences count


@pytest.mark.parametrize("prompt", OPEN_PROMPTS)
def test_open_prompts_do_not_loop(demo, prompt):
    done = demo.generate(prompt, chat=True, max_tokens=256)  # the file's settings, no flags
    assert max_ngram_count(list(done.tokens), NGRAM) < TIMES, done.text


def test_factual_answers_stay_right(demo):
    answers = [(q, demo.generate(q, chat=True, seed=s, max_tokens=48).text)
               for q, _ in FACTS for s in SEEDS]  # fmt: skip
    patterns = dict(FACTS)
    right = sum(bool(re.search(patterns[q], text)) for q, text in answers)
    assert right >= 18, answers
