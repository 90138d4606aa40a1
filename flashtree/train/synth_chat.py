"""Synthetic chat dialogues: questions and answers, arithmetic with worked steps, small text tasks.

Every answer is computed from its question, so the text is both correct and highly regular: a tiny
model can learn it well, and a well-learned target is predictable, which is what lets a DFlash
draft reach long acceptance lengths. Only the final turn carries `<think>` reasoning, because the
chat template drops reasoning from turns before the last user query.
"""

from __future__ import annotations

import random
from typing import Callable, Optional

from .lexicon import ANIMAL_FACTS, CAPITALS, CONCEPTS, FIRST_NAMES, IDENTIFIERS, THINGS, WORDS

# one exchange: (user text, assistant answer, reasoning or None)
Turn = tuple[str, str, Optional[str]]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly and accurately.",
    "You are a friendly assistant that explains things step by step.",
    "You are a coding assistant. Prefer short, working Python examples.",
]


def _capital(rng: random.Random) -> Turn:
    country = rng.choice(sorted(CAPITALS))
    q = rng.choice(["What is the capital of {c}?", "What's the capital city of {c}?",
                    "Which city is the capital of {c}?", "Tell me the capital of {c}."]).format(c=country)
    return q, f"The capital of {country} is {CAPITALS[country]}.", None


def _concept(rng: random.Random) -> Turn:
    name = rng.choice(sorted(CONCEPTS))
    q = rng.choice(["What is a {n}?", "Can you explain what a {n} is?", "Explain {n} in one paragraph.",
                    "What does {n} mean in programming?"]).format(n=name)
    return q, CONCEPTS[name], None


def _animal(rng: random.Random) -> Turn:
    name = rng.choice(sorted(ANIMAL_FACTS))
    q = rng.choice(["Tell me about the {a}.", "What is a {a}?", "Give me a fact about the {a}."]).format(a=name)
    return q, ANIMAL_FACTS[name], None


_HOWTO = [
    ("How do I reverse a list called `{v}` in Python?",
     "Use slicing with a step of -1:\n\n```python\nreversed_{v} = {v}[::-1]\n```\n\nThis returns a new list; `{v}.reverse()` reverses it in place instead."),
    ("How can I sort `{v}` in descending order?",
     "Pass `reverse=True` to `sorted`:\n\n```python\n{v}_sorted = sorted({v}, reverse=True)\n```\n\nUse `{v}.sort(reverse=True)` to sort the list in place."),
    ("How do I remove duplicates from `{v}` but keep the order?",
     "Use `dict.fromkeys`, which keeps the first occurrence of each item:\n\n```python\nunique_{v} = list(dict.fromkeys({v}))\n```"),
    ("How do I count how often each item appears in `{v}`?",
     "Use `collections.Counter`:\n\n```python\nfrom collections import Counter\n\ncounts = Counter({v})\nprint(counts.most_common(3))\n```"),
    ("How do I read all lines of a file named `{f}`?",
     "Open it with a `with` block so it is closed afterwards:\n\n```python\nwith open(\"{f}\") as f:\n    lines = f.read().splitlines()\n```"),
    ("Write a function that returns the sum of the even numbers in `{v}`.",
     "Here is one way:\n\n```python\ndef sum_even({v}):\n    return sum(x for x in {v} if x % 2 == 0)\n```\n\nFor example, `sum_even([1, 2, 3, 4])` returns `6`."),
    ("How do I get the largest value in `{v}`?",
     "Use the built-in `max`:\n\n```python\nlargest = max({v})\n```\n\nIt raises `ValueError` if `{v}` is empty; pass `default=None` to avoid that."),
    ("Write a function that checks whether a string is a palindrome.",
     "Compare the string with its reverse:\n\n```python\ndef is_palindrome(text):\n    cleaned = text.lower().replace(\" \", \"\")\n    return cleaned == cleaned[::-1]\n```"),
    ("How do I loop over `{v}` with the index of each item?",
     "Use `enumerate`:\n\n```python\nfor index, item in enumerate({v}):\n    print(index, item)\n```"),
    ("How do I write `{v}` to a JSON file?",
     "Use the `json` module:\n\n```python\nimport json\n\nwith open(\"{v}.json\", \"w\") as f:\n    json.dump({v}, f, indent=2)\n```"),
    ("Write a function that returns the factorial of n.",
     "A simple loop works:\n\n```python\ndef factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n```\n\nFor example, `factorial(5)` returns `120`."),
    ("How do I merge two dictionaries `a` and `b`?",
     "Use the `|` operator (Python 3.9+):\n\n```python\nmerged = a | b\n```\n\nValues from `b` win when a key is in both."),
]


def _howto(rng: random.Random) -> Turn:
    q, a = rng.choice(_HOWTO)
    fields = {"v": rng.choice(IDENTIFIERS), "f": rng.choice(WORDS) + rng.choice([".txt", ".csv", ".log"])}
    return q.format(**fields), a.format(**fields), None


def _add_steps(a: int, b: int) -> str:
    lines, carry, place = [], 0, 0
    names = ["ones", "tens", "hundreds", "thousands", "ten-thousands"]
    x, y = a, b
    while x or y or carry:
        dx, dy = x % 10, y % 10
        s = dx + dy + carry
        parts = f"{dx} + {dy}" + (f" + {carry}" if carry else "")
        note = f", write {s % 10}, carry {s // 10}" if s >= 10 else f", write {s}"
        lines.append(f"- {names[place]}: {parts} = {s}{note}")
        carry, x, y, place = s // 10, x // 10, y // 10, place + 1
    return "\n".join(lines)


def _arithmetic(rng: random.Random) -> tuple[str, str, str]:
    """(question, worked steps, final sentence)."""
    op = rng.choice(["add", "sub", "mul", "div", "pct"])
    if op == "add":
        a, b = rng.randint(10, 9999), rng.randint(10, 9999)
        q = rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} plus {b}."]).format(a=a, b=b)
        steps = f"Add {a} and {b} column by column:\n{_add_steps(a, b)}"
        return q, steps, f"{a} + {b} = {a + b}."
    if op == "sub":
        a, b = sorted((rng.randint(10, 9999), rng.randint(10, 9999)), reverse=True)
        q = rng.choice(["What is {a} - {b}?", "Subtract {b} from {a}.", "Compute {a} minus {b}."]).format(a=a, b=b)
        steps = f"{a} - {b} = {a - b}. Check: {a - b} + {b} = {a}."
        return q, steps, f"{a} - {b} = {a - b}."
    if op == "mul":
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        tens, ones = b - b % 10, b % 10
        q = rng.choice(["What is {a} * {b}?", "Multiply {a} by {b}.", "Compute {a} times {b}."]).format(a=a, b=b)
        steps = (f"Split {b} into {tens} + {ones}:\n{a} * {tens} = {a * tens}\n{a} * {ones} = {a * ones}\n"
                 f"{a * tens} + {a * ones} = {a * b}")
        return q, steps, f"{a} * {b} = {a * b}."
    if op == "div":
        b = rng.randint(2, 12)
        a = b * rng.randint(2, 99) + rng.randint(0, b - 1)
        quo, rem = divmod(a, b)
        q = rng.choice(["What is {a} divided by {b}?", "Divide {a} by {b}.", "What is {a} / {b}?"]).format(a=a, b=b)
        steps = f"{b} * {quo} = {b * quo}, and {a} - {b * quo} = {rem}."
        tail = f" remainder {rem}" if rem else ""
        return q, steps, f"{a} divided by {b} is {quo}{tail}."
    p, n = rng.choice([5, 10, 20, 25, 50, 75]), rng.randint(1, 40) * 20
    q = rng.choice(["What is {p}% of {n}?", "Compute {p} percent of {n}."]).format(p=p, n=n)
    steps = f"{p}% of {n} = {n} * {p} / 100 = {n * p // 100}."
    return q, steps, f"{p}% of {n} is {n * p // 100}."


def _word_problem(rng: random.Random) -> tuple[str, str, str]:
    who, thing = rng.choice(FIRST_NAMES), rng.choice(THINGS)
    have, more, give = rng.randint(5, 60), rng.randint(2, 40), rng.randint(1, 30)
    give = min(give, have + more)
    q = (f"{who} has {have} {thing}, buys {more} more and then gives away {give}. "
         f"How many {thing} does {who} have now?")
    steps = (f"Start with {have} {thing}.\nAfter buying {more}: {have} + {more} = {have + more}.\n"
             f"After giving away {give}: {have + more} - {give} = {have + more - give}.")
    return q, steps, f"{who} has {have + more - give} {thing} now."


def _math(rng: random.Random) -> Turn:
    q, steps, final = _word_problem(rng) if rng.random() < 0.3 else _arithmetic(rng)
    if rng.random() < 0.4:
        return q, final, steps
    return q, f"{steps}\n\nAnswer: {final}", None


def _text_task(rng: random.Random) -> Turn:
    word = rng.choice(WORDS)
    kind = rng.randrange(5)
    if kind == 0:
        return f"Spell the word \"{word}\" backwards.", f"\"{word}\" backwards is \"{word[::-1]}\".", None
    if kind == 1:
        return f"How many letters are in the word \"{word}\"?", f"The word \"{word}\" has {len(word)} letters.", None
    if kind == 2:
        n = sum(ch in "aeiou" for ch in word)
        return (f"How many vowels does \"{word}\" contain?",
                f"\"{word}\" contains {n} vowel{'s' if n != 1 else ''}.", None)
    nums = [rng.randint(0, 99) for _ in range(rng.randint(3, 7))]
    text = ", ".join(map(str, nums))
    if kind == 3:
        return f"Sort these numbers from smallest to largest: {text}.", \
            f"Sorted: {', '.join(map(str, sorted(nums)))}.", None
    return f"What is the sum of {text}?", \
        f"{' + '.join(map(str, nums))} = {sum(nums)}.", None


_GREETINGS = [("Hi!", "Hello! How can I help you today?"),
              ("Hello, who are you?", "I am a small assistant model. I can answer questions, do arithmetic and call tools."),
              ("Good morning!", "Good morning! What can I do for you?")]
_THANKS = [("Thanks!", "You're welcome!"), ("Thank you, that helps.", "Glad it helped! Let me know if you have more questions."),
           ("Great, thanks a lot.", "You're welcome. Happy to help.")]

GENERATORS: list[Callable[[random.Random], Turn]] = [_capital, _concept, _animal, _howto, _math, _math,
                                                     _text_task, _howto]


def chat_dialogue(rng: random.Random) -> list[dict]:
    """One conversation in chat-message format: optional system prompt, 1-4 exchanges."""
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    turns: list[Turn] = []
    if rng.random() < 0.2:
        turns.append((*rng.choice(_GREETINGS), None))
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        turns.append(rng.choice(GENERATORS)(rng))
    if len(turns) > 1 and rng.random() < 0.25:
        turns.append((*rng.choice(_THANKS), None))
    for i, (user, answer, reasoning) in enumerate(turns):
        messages.append({"role": "user", "content": user})
        reply = {"role": "assistant", "content": answer}
        if reasoning and i == len(turns) - 1:
            reply["reasoning_content"] = reasoning
        messages.append(reply)
    return messages
