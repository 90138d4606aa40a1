"""Small file and shell tasks for the agent stage, independent of any client.

The user asks for one of five kinds of task (create a file with given content, append a line,
list a directory, run a command and report its output, read a file and answer from it); an
Episode holds the request, the operation it needs, what the operation gives back, the final
answer and what a harness checks. synth_client_agent.py renders an episode in each agent
client's own tools and request format.

Names, contents and phrasings are split once into a training part and a held-out part that
training never sees (a stable CRC32 of each item), so held-out tasks, also those `clients.run`
gives real clients, test whether the model learned to copy arguments rather than recall them.
"""

from __future__ import annotations

import random
import shlex
import string
import zlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from .lexicon import WORDS, embedded_vocabulary, invented_name

FAMILIES = ("create", "append", "list", "run", "read")

_STEMS = sorted(set(WORDS) | {
    "notes", "todo", "hello", "greeting", "summary", "draft", "memo", "ideas", "plan",
    "tasks", "message", "journal", "inventory", "colors", "fruits", "names",
    "scores", "shopping", "recipe", "budget", "agenda", "contacts", "quotes", "release",
    "changelog", "welcome", "answers", "config", "settings", "guests", "books", "songs", "birds"})
_EXTENSIONS = [".txt", ".md", ".log", ".txt", ".csv"]
_WORDS = sorted(set(WORDS) | {
    "blue", "green", "quiet", "bright", "morning", "evening", "ocean", "harbor", "lantern", "meadow",
    "copper", "violet", "thunder", "maple", "orbit", "pebble", "saffron", "velvet", "willow", "ember",
    "falcon", "glacier", "honey", "island", "jasmine", "kettle", "lemon", "marble", "nectar", "olive"})
_DIRS = ["src", "docs", "data", "notes", "logs", "scripts", "config", "assets", "build", "tmp",
         "reports", "drafts", "archive", "images", "lib", "tests", "backup", "inbox", "public", "site"]
# working directories' project names: apart from the split pools, so no held-out item hides in a path
_KEYS = ["color", "size", "owner", "city", "count", "status", "version", "level", "name", "mode"]
# phrasings per family; the last one of each is the held-out one. Training sees many ways of
# asking (and openers/closers around them) so that the model learns to copy the arguments out
# of a request, not to recognise a handful of sentences.
_PHRASINGS = {
    "create": ["Create a file named {name} containing the text: {content}",
               "Write \"{content}\" to a new file called {name}.",
               "Make a file {name} with the content {content}",
               "Please create {name} and put this text in it: {content}",
               "Save the text \"{content}\" in a file named {name}.",
               "Create {name} with the text \"{content}\".",
               "Write a file called {name} that contains: {content}",
               "I want a new file {name} containing {content}",
               "Can you make a file named {name}? It should read: {content}",
               "Could you write {content} into {name}?",
               "New file {name}, content: {content}",
               "Put the text \"{content}\" into a new file {name}.",
               "Create the file {name}. Its text should be: {content}",
               "Please write a file {name} which says {content}",
               "Generate {name} containing exactly: {content}",
               "Store \"{content}\" in {name}.",
               "{name} should be a new file with the words: {content}",
               "I need a file called {name} that says: {content}"],
    "append": ["Append the line \"{line}\" to {name}.",
               "Add a line saying {line} at the end of {name}.",
               "Add \"{line}\" as a new last line of the file {name}.",
               "Please append {line} to the file {name}.",
               "Append \"{line}\" to the end of {name}.",
               "Add the line {line} to {name}.",
               "Can you add \"{line}\" to the end of {name}?",
               "Write \"{line}\" as an extra line at the end of {name}.",
               "At the end of {name}, add the line: {line}",
               "{name} needs one more line at the end: {line}",
               "Insert \"{line}\" as the final line of {name}.",
               "Could you append the text {line} to {name}?",
               "Tack \"{line}\" onto the end of {name}.",
               "Put the line \"{line}\" at the bottom of {name}."],
    "list": ["List the files in the {dir} directory.",
             "What files are in {dir}?",
             "Show me what is inside the {dir} folder.",
             "Which files does the directory {dir} contain?",
             "Can you list the contents of {dir}?",
             "Please show the files under {dir}.",
             "What is in the {dir} directory?",
             "Tell me the names of the files in {dir}/."],
    "run": ["Run the shell command `{cmd}` and tell me what it printed.",
            "Execute `{cmd}` and report its output.",
            "What does `{cmd}` print? Run it.",
            "Please run {cmd} in the terminal and show me the output.",
            "Run {cmd} and tell me what it outputs.",
            "Please execute `{cmd}` and give me the output.",
            "Can you run `{cmd}`? I want to see what it prints.",
            "Show me the output of `{cmd}`.",
            "Use the shell to run `{cmd}` and report back.",
            "Try `{cmd}` and let me know what it says.",
            "I'd like to know the output of running `{cmd}`.",
            "Run `{cmd}` for me and tell me the result."],
    "read": ["Read {name} and tell me the {key}.",
             "What is the {key} in the file {name}?",
             "Look at {name}: which {key} does it give?",
             "Open {name} and tell me its {key} value.",
             "Can you read {name} and find the {key}?",
             "Which {key} is written in {name}?",
             "Please check the file {name} for its {key}.",
             "Check {name} and report the {key}."],
}
# around a training request, sometimes (never around a held-out one)
_OPENERS = ["Hi! ", "Hello. ", "Quick task: ", "One thing: ", "Next task. ", "Hey there! "]
_CLOSERS = [" Thanks!", " Thank you.", " Keep it short.", " Nothing else, please."]


SPLIT_ITEMS = set(_STEMS) | set(_WORDS) | set(_DIRS)


def is_heldout(item: str) -> bool:
    """The stable split of names, contents and phrasings: one item in four is held out."""
    return zlib.crc32(item.encode()) % 4 == 0


@dataclass(frozen=True)
class Pools:
    """The names, words, directories and phrasings one split draws from."""

    stems: list[str]
    words: list[str]
    dirs: list[str]
    phrasings: dict[str, list[str]]
    heldout: bool = False

    @classmethod
    def split(cls, heldout: bool) -> "Pools":
        def pick(items: list[str]) -> list[str]:
            return [x for x in items if is_heldout(x) == heldout]

        # every family keeps at least one phrasing on each side: the last one is always held out
        phrasings = {f: ([p[-1]] if heldout else p[:-1]) for f, p in _PHRASINGS.items()}
        return cls(pick(_STEMS), pick(_WORDS), pick(_DIRS), phrasings, heldout)


@dataclass(frozen=True)
class Episode:
    """One task, client-independent: the request, the operation it needs, what the operation
    gives back, the final answer, and what a harness checks (file + content, or answer)."""

    family: str
    task: str
    op: str  # "write", "shell", "read" or "list"
    path: str  # the file or directory it acts on ("" for a bare command)
    content: str  # the text written (write) or the file's text (read)
    command: str  # the shell command (append, run)
    output: str  # what the command printed, the file read, or the directory's entries (one a line)
    answer: str
    check: dict[str, str]


def invented_word(rng: random.Random) -> str:
    """A made-up lowercase word on the training side of the split: training contents and names
    are half invented, so that the model learns to copy them from the request rather than to
    pick them from a list it memorised (it wrote training words into held-out files otherwise)."""
    while True:
        word = invented_name(rng).lower()
        if not is_heldout(word):
            return word


@lru_cache(maxsize=1)
def _vocabulary_pieces() -> list[str]:
    """The embedded tokenizer's lowercase alphabetic pieces ('protocols', 'azen', 'ar', ...; about
    3.7K), less the held-out items. Invented words are made of a few dozen syllables: trained on
    them alone, the model copied those tokens and nothing else, and wrote 'ket answer' for a
    held-out 'kettle' (' k', 'et', 'tle'); words glued from any pieces make it copy any token."""
    pieces = {t.strip() for t in embedded_vocabulary()}
    return sorted(p for p in pieces if p.isascii() and p.isalpha() and p.islower()
                  and not (p in SPLIT_ITEMS and is_heldout(p)))


def glued_word(rng: random.Random) -> str:
    """A training-side word of one to three tokenizer pieces, or of random letters."""
    while True:
        if rng.random() < 0.2:
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
        else:
            word = "".join(rng.choice(_vocabulary_pieces()) for _ in range(rng.choice([1, 1, 2, 2, 3])))
        if not (word in SPLIT_ITEMS and is_heldout(word)):
            return word


def _word(rng: random.Random, pools: Pools, items: list[str]) -> str:
    """A held-out item, or in training a listed item, an invented word or a glued one."""
    if pools.heldout:
        return rng.choice(items)
    roll = rng.random()
    return invented_word(rng) if roll < 0.3 else glued_word(rng) if roll < 0.6 else rng.choice(items)


def _name(rng: random.Random, pools: Pools) -> str:
    return _word(rng, pools, pools.stems) + rng.choice(_EXTENSIONS)


def _words(rng: random.Random, pools: Pools, n: int) -> list[str]:
    words: list[str] = []
    while len(words) < n:
        word = _word(rng, pools, pools.words)
        if word not in words:
            words.append(word)
    return words


def _phrase(rng: random.Random, pools: Pools) -> str:
    words = _words(rng, pools, rng.randint(2, 4))
    return " ".join(words) + (f" {rng.randint(1, 99)}" if rng.random() < 0.3 else "")


def _task(rng: random.Random, pools: Pools, family: str, **fields: str) -> str:
    """The request: a phrasing of the family with its fields, and in training, sometimes an
    opener or a closer around it."""
    task = rng.choice(pools.phrasings[family]).format(**fields)
    if not pools.heldout:
        if rng.random() < 0.25:
            task = rng.choice(_OPENERS) + task
        if rng.random() < 0.2:
            task += rng.choice(_CLOSERS)
    return task


def _create(rng: random.Random, pools: Pools) -> Episode:
    name, content = _name(rng, pools), _phrase(rng, pools)
    task = _task(rng, pools, "create", name=name, content=content)
    answer = rng.choice(["Created {n} containing: {c}", "Done. {n} now contains \"{c}\".",
                         "I wrote \"{c}\" to {n}."]).format(n=name, c=content)
    return Episode("create", task, "write", name, content, "", "", answer, {"file": name, "content": content})


def _append(rng: random.Random, pools: Pools) -> Episode:
    name, line = _name(rng, pools), _phrase(rng, pools)
    task = _task(rng, pools, "append", name=name, line=line)
    answer = rng.choice(["Appended \"{l}\" to {n}.", "Done: {n} now ends with the line \"{l}\"."]).format(
        n=name, l=line)
    return Episode("append", task, "shell", name, "", f"echo {shlex.quote(line)} >> {name}", "", answer,
                   {"file": name, "content": line})


def _list(rng: random.Random, pools: Pools) -> Episode:
    directory = rng.choice(pools.dirs)
    files = sorted({_name(rng, pools) for _ in range(rng.randint(1, 5))})
    task = _task(rng, pools, "list", dir=directory)
    answer = (f"The {directory} directory contains {len(files)} file{'s' if len(files) > 1 else ''}: "
              f"{', '.join(files)}.")
    return Episode("list", task, "list", directory, "", f"ls {directory}", "\n".join(files), answer,
                   {"answer": files[0]})


def _command(rng: random.Random, pools: Pools) -> tuple[str, str]:
    """A shell command and what it prints, computed here (so the answer can only come from
    running it)."""
    kind = rng.randrange(6)
    a, b = rng.randint(2, 9999), rng.randint(2, 99)
    words = _words(rng, pools, rng.randint(2, 4))
    if kind == 0:
        return f"echo {words[0]}-{a}", f"{words[0]}-{a}"
    if kind == 1:
        return f"expr {a} + {b}", str(a + b)
    if kind == 2:
        return f"python3 -c 'print({a} * {b})'", str(a * b)
    if kind == 3:
        return f"echo {words[0]} | rev", words[0][::-1]
    if kind == 4:
        return f"printf '%s\\n' {' '.join(words)} | sort", "\n".join(sorted(words))
    return f"echo {' '.join(words)} | wc -w", str(len(words))


def _run(rng: random.Random, pools: Pools) -> Episode:
    command, output = _command(rng, pools)
    task = _task(rng, pools, "run", cmd=command)
    # The output is quoted where no space comes before it (a line's start, a backtick), as in the
    # tool result: ' regit' and 'regit' are other tokens, and the first round's target, asked to put
    # a command's output after a space, wrote another word (`echo kettle | rev`: no 'elttek').
    if "\n" in output:
        answer = f"The command printed:\n{output}"
    else:
        answer = rng.choice(["The command printed:\n{o}", "It printed `{o}`.", "The output is `{o}`."]).format(o=output)
    return Episode("run", task, "shell", "", "", command, output, answer, {"answer": output.splitlines()[0]})


def _read(rng: random.Random, pools: Pools) -> Episode:
    name = _name(rng, pools)
    keys = rng.sample(_KEYS, rng.randint(2, 4))
    values = {k: str(rng.randint(1, 500)) if k in ("count", "size", "level", "version") else _word(rng, pools, pools.words)
              for k in keys}
    key = rng.choice(keys)
    text = "\n".join(f"{k}: {values[k]}" for k in keys)
    task = _task(rng, pools, "read", name=name, key=key)
    answer = rng.choice(["The {k} in {n} is {v}.", "{n} gives {k}: {v}.", "According to {n}, the {k} is {v}."]).format(
        k=key, n=name, v=values[key])
    return Episode("read", task, "read", name, text, "", text, answer, {"answer": values[key]})


_FAMILY_FNS = {"create": _create, "append": _append, "list": _list, "run": _run, "read": _read}


def episode(rng: random.Random, pools: Pools, family: Optional[str] = None) -> Episode:
    return _FAMILY_FNS[family or rng.choice(FAMILIES)](rng, pools)


def heldout_episodes(n: int, seed: int = 0) -> list[Episode]:
    """`n` held-out episodes a real client can be checked on in one empty directory (create, append,
    run, in turn; no two touch the same file, and no answer that the request itself already holds,
    such as `echo word`'s)."""
    rng, pools = random.Random(seed), Pools.split(heldout=True)
    families = ("create", "append", "run")
    episodes: list[Episode] = []
    files: set[str] = set()
    while len(episodes) < n:
        ep = episode(rng, pools, families[len(episodes) % 3])
        if ep.check.get("file") in files or ep.check.get("answer", "\0") in ep.task:
            continue
        files.add(ep.check.get("file", ""))
        episodes.append(ep)
    return episodes


def heldout_tasks(n: int, seed: int = 0) -> list[dict[str, str]]:
    """The held-out episodes as tasks: {"prompt", "family", and "file" + "content" or "answer"}."""
    return [{"prompt": ep.task, "family": ep.family, **ep.check} for ep in heldout_episodes(n, seed)]

