"""The <think> splitter: channels, framing whitespace, tags cut anywhere, prompts that open the
block for the model, a stray `</think>` outside a block."""

import pytest

from flashtree.serve.reasoning import (ReasoningSplitter, prompt_opens_reasoning,
                                       uses_reasoning_tags)


def run(pieces, start_in_reasoning=False):
    splitter = ReasoningSplitter(start_in_reasoning)
    out = []
    for piece in pieces:
        out.extend(splitter.feed(piece))
    out.extend(splitter.finish())
    merged = []
    for channel, text in out:
        assert text, "no empty deltas"
        if merged and merged[-1][0] == channel:
            merged[-1] = (channel, merged[-1][1] + text)
        else:
            merged.append((channel, text))
    return merged


CASES = [
    ("<think>\nLet me think \u2603.\n\n</think>\n\nThe answer is 4.",
     False, [("reasoning", "Let me think \u2603."), ("content", "The answer is 4.")]),
    ("It is \u4f60\u597d.\n</think>\n\nAnswer: 4\n", True,
     [("reasoning", "It is \u4f60\u597d."), ("content", "Answer: 4\n")]),
    ("plain answer, no thoughts", False, [("content", "plain answer, no thoughts")]),
    ("a <thinking> b </think not a tag", False, [("content", "a <thinking> b </think not a tag")]),
    ("<think>one</think>mid<think>two</think>end", False,
     [("reasoning", "one"), ("content", "mid"), ("reasoning", "two"), ("content", "end")]),
    ("<think>\nstill thinking when the limit hit\n", False,
     [("reasoning", "still thinking when the limit hit\n")]),
    ("<think>\n\n</think>\n\nanswer", False, [("content", "answer")]),
    # thinking off, the model thinks anyway: its `</think>` is markup, never content
    ("Split 5.\n</think>\n\nNora has 2.", False, [("content", "Split 5.\nNora has 2.")]),
    ("a</think>b</think>", False, [("content", "ab")]),
]


@pytest.mark.parametrize("text,start,expected", CASES)
def test_split(text, start, expected):
    assert run([text], start) == expected


@pytest.mark.parametrize("text,start,expected", CASES)
def test_split_is_independent_of_cut_points(text, start, expected):
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]], start) == expected, cut
    assert run(list(text), start) == expected


def test_prompt_state_detection():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert uses_reasoning_tags("{% if x %}<think>{% endif %}")
    assert not uses_reasoning_tags("{{ messages }}")
    assert not uses_reasoning_tags(None)
