"""Word banks the synthetic dialogues draw from.

Kept apart from the generators so the generators read as grammar, not as data. Real names give the
text a natural look; `invented_name` mixes in made-up ones so the model must learn to copy names
from the prompt (into tool arguments and answers) rather than recall a fixed list.
"""

from __future__ import annotations

import random
from functools import lru_cache

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Brazil": "Brasilia",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Australia": "Canberra", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara", "Argentina": "Buenos Aires",
    "Chile": "Santiago", "Peru": "Lima", "Ireland": "Dublin", "Austria": "Vienna",
    "Hungary": "Budapest", "Netherlands": "Amsterdam", "Belgium": "Brussels", "Denmark": "Copenhagen",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "South Korea": "Seoul", "Morocco": "Rabat",
    "Nigeria": "Abuja", "Iceland": "Reykjavik", "Czechia": "Prague", "Romania": "Bucharest",
    "Colombia": "Bogota", "Indonesia": "Jakarta", "New Zealand": "Wellington",
}

CITIES = sorted(set(CAPITALS.values()) | {
    "London", "New York", "Chicago", "Toronto", "Sydney", "Melbourne", "Osaka", "Munich",
    "Barcelona", "Milan", "Zurich", "Geneva", "Lyon", "Hamburg", "Seattle", "Boston", "Denver",
    "Austin", "Vancouver", "Montreal", "Singapore", "Dubai", "Istanbul", "Mumbai", "Shanghai",
    "Cape Town", "San Francisco", "Los Angeles", "Edinburgh", "Kyoto", "Porto", "Krakow",
})

FIRST_NAMES = ["Alice", "Bob", "Carol", "David", "Eve", "Frank", "Grace", "Hector", "Ines", "Jun",
               "Kara", "Liam", "Maya", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq",
               "Uma", "Victor", "Wen", "Yara", "Zoe"]

THINGS = ["apples", "books", "pencils", "marbles", "cookies", "stamps", "coins", "cards",
          "shells", "stickers", "oranges", "bottles", "boxes", "chairs", "tickets"]

CONDITIONS = ["sunny", "cloudy", "rainy", "partly cloudy", "windy", "snowy", "foggy", "clear"]

CONCEPTS = {
    "list": "A list is an ordered, mutable collection of items. You create one with square brackets, for example `[1, 2, 3]`.",
    "tuple": "A tuple is an ordered, immutable collection of items. You create one with parentheses, for example `(1, 2, 3)`.",
    "dictionary": "A dictionary maps keys to values. You create one with braces, for example `{\"a\": 1}`.",
    "set": "A set is an unordered collection of unique items. You create one with `set()` or braces, for example `{1, 2, 3}`.",
    "function": "A function is a named block of code that takes arguments and returns a value. You define one with `def`.",
    "class": "A class is a blueprint for objects. It groups data (attributes) with the functions that act on it (methods).",
    "loop": "A loop repeats a block of code. Python has `for` loops over iterables and `while` loops that run while a condition holds.",
    "generator": "A generator is a function that uses `yield` to produce values one at a time, lazily, instead of building a whole list.",
    "decorator": "A decorator is a function that takes a function and returns a new function, used with the `@name` syntax above a definition.",
    "module": "A module is a Python file whose functions, classes and variables you can import into other code.",
    "variable": "A variable is a name that refers to a value. You create one by assignment, for example `x = 5`.",
    "string": "A string is an immutable sequence of characters, written in quotes, for example `\"hello\"`.",
    "exception": "An exception is an error raised while a program runs. You handle it with a `try` / `except` block.",
    "recursion": "Recursion is when a function calls itself to solve a smaller piece of the same problem, stopping at a base case.",
    "API": "An API (application programming interface) is a set of functions or endpoints that one program offers for others to call.",
    "compiler": "A compiler translates source code into machine code or bytecode before the program runs.",
    "database": "A database stores data in an organized way so that programs can query and update it efficiently.",
    "hash table": "A hash table stores key-value pairs and finds a key in constant time on average by hashing it to a bucket.",
    "binary search": "Binary search finds an item in a sorted list by halving the search range at each step, in O(log n) time.",
    "stack": "A stack is a last-in, first-out collection: you push items on top and pop them from the top.",
    "queue": "A queue is a first-in, first-out collection: you add items at the back and remove them from the front.",
}

ANIMAL_FACTS = {
    "cat": "A cat is a small domesticated carnivore. Cats sleep for about 12 to 16 hours a day.",
    "dog": "A dog is a domesticated descendant of the wolf. Dogs have a very strong sense of smell.",
    "elephant": "An elephant is the largest land animal. Elephants use their trunks to drink, eat and greet each other.",
    "owl": "An owl is a bird of prey that hunts mostly at night. Owls can turn their heads about 270 degrees.",
    "dolphin": "A dolphin is a marine mammal. Dolphins breathe air through a blowhole and live in groups called pods.",
    "bee": "A bee is a flying insect that collects nectar and pollen. Honey bees live in colonies with one queen.",
    "penguin": "A penguin is a flightless bird that lives mostly in the Southern Hemisphere. Penguins are excellent swimmers.",
}

WORDS = ["python", "garden", "rocket", "window", "silver", "planet", "coffee", "bridge", "market",
         "yellow", "summer", "dragon", "pencil", "forest", "engine", "castle", "button", "candle",
         "mirror", "puzzle", "river", "cloud", "apple", "table", "music", "light", "stone", "tiger"]

IDENTIFIERS = ["items", "values", "numbers", "names", "data", "scores", "words", "records",
               "users", "prices", "lines", "results", "entries", "tasks", "files"]

_SYLLABLES = ["ka", "lo", "mi", "ra", "to", "ve", "shi", "na", "dor", "bel", "an", "qu", "zen",
              "mar", "tel", "gra", "fio", "pe", "sa", "lin"]


def invented_name(rng: random.Random) -> str:
    """A pronounceable made-up proper name such as 'Velomar'."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def city(rng: random.Random) -> str:
    """A real city most of the time, an invented one otherwise."""
    return invented_name(rng) if rng.random() < 0.3 else rng.choice(CITIES)


@lru_cache(maxsize=1)
def embedded_vocabulary() -> tuple[str, ...]:
    """The embedded tokenizer's tokens as text, in id order, with '' for its added tokens
    (`<|im_end|>`, `<think>`, ...): the raw material of words no list holds
    (synth_tasks' glued words, synth_copy's drill)."""
    from tokenizers import Tokenizer

    from ..checkpoint.resolve import EMBEDDED

    tok = Tokenizer.from_file(str(EMBEDDED / "target" / "tokenizer.json"))
    added = set(tok.get_added_tokens_decoder())
    return tuple("" if i in added else tok.decode([i]) for i in range(tok.get_vocab_size()))
