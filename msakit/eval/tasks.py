"""Retrieval tasks generated offline with the model's own tokenizer (RULER-style, seeded).

Every sample is a token sequence of exactly `length` tokens: the prompt followed by the
answer.  Its pieces (instruction, haystack paragraphs, needles, question, answer) are tokenized
one by one and the token lists concatenated, so the length is exact and the needle's position
is known; each piece ends in a newline (or the question in a word before the answer), so the
pieces join where the tokenizer would split anyway.  The haystack is noise: one paragraph
repeated ("The grass is green. ..."), truncated to the exact length in its last copy; the
question starts on a new line.

- ``passkey``: a 5-digit pass key hidden in the noise; "What is the pass key? The pass key is"
  -> " 71432".
- ``niah``: multi-key needle in a haystack: ``num_needles`` needles "One of the special magic
  numbers for {key} is: {7 digits}." with distinct two-word keys; the question asks for one key's
  number (the target needle sits at the requested depth, the others at seeded random places) and
  ends in "is:", as the needle does, so the answer " {7 digits}" follows in the needle's format.
- ``vt``: variable tracking: "VAR AAAAA = 12345." then ``hops`` assignments "VAR BBBBB = VAR
  AAAAA." spread from the requested depth to the end; the answer lists every variable holding
  the value, in the order they were assigned, space-separated: the instruction holds one short
  worked example in that format (RULER's one-shot example), which teacher-forced scoring needs.

Depth is the needle's place in the haystack: it starts at the paragraph boundary nearest to
``depth * haystack_tokens`` (0 = first, 1 = just before the question).

Scoring (`msakit.eval.scoring.answer_scores`) is teacher-forced: one forward over the sample;
exact match means the greedy argmax at every answer position equals the answer's token, which
is exactly what greedy decoding of the answer would produce.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["RETRIEVAL_TASKS", "TASK_VERSION", "Sample", "TokenPieces", "decoder", "encoder", "make_sample", "make_samples", "sample_rng"]

RETRIEVAL_TASKS = ("passkey", "niah", "vt")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.\n")
NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n")
VT_INTRO = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
            "Example:\nVAR QPWOE = 83421.\nThe grass is green. The sky is blue.\nVAR ZMXNC = VAR QPWOE.\n"
            "VAR RTYUI = VAR ZMXNC.\nQuestion: Find all variables that are assigned the value 83421 in the text "
            "above.\nAnswer: According to the chain(s) of variable assignment in the text above, 3 variables are "
            "assigned the value 83421, they are: QPWOE ZMXNC RTYUI\n\nText:\n")
_VT_EXAMPLE_NAMES = ("QPWOE", "ZMXNC", "RTYUI")
TASK_VERSION = 2  # bumped whenever a generated sample changes (an output folder keeps one version)
_ADJ = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively",
        "misty", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "urban", "vivid", "wild", "young")
_NOUN = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quartz", "river", "saddle", "tunnel",
         "violin", "walnut", "yarrow", "zephyr")
_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

Encode = Callable[[str], list]


@dataclass
class Sample:
    """One generated retrieval sample: `input_ids` (prompt + answer, exactly `length` tokens).

    The answer is ``input_ids[answer_start:]``; `needle_pos` is the first token of the target
    needle; `haystack` the [start, end) token range of the noise with its needles; `meta` holds
    the task's own fields (the key, the variable names)."""

    task: str
    length: int
    depth: float
    index: int
    input_ids: list[int]
    answer_start: int
    answer: str
    needle_pos: int
    haystack: tuple[int, int] = (0, 0)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def answer_ids(self) -> list[int]:
        return self.input_ids[self.answer_start:]

    def to_dict(self, with_ids: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_ids:
            d.pop("input_ids")
        return d


def encoder(tokenizer: Any) -> Encode:
    """A text -> token ids function (no special tokens) for a `tokenizers.Tokenizer`, a
    transformers tokenizer, or a callable returning a list of ints."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        Tokenizer = ()  # type: ignore[assignment]
    if isinstance(tokenizer, Tokenizer):
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False).ids)
    if hasattr(tokenizer, "encode") and hasattr(tokenizer, "convert_ids_to_tokens"):  # transformers
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    if callable(tokenizer):
        return lambda text: [int(t) for t in tokenizer(text)]
    raise ValueError(f"tokenizer must be a tokenizers.Tokenizer, a transformers tokenizer or a callable, "
                     f"got {type(tokenizer).__name__}")


def decoder(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """A token ids -> text function for a `tokenizers.Tokenizer` or a transformers tokenizer (special
    tokens dropped); ValueError for a tokenizer without ``decode``."""
    if not hasattr(tokenizer, "decode"):
        raise ValueError(f"generation needs a tokenizer with decode (tokenizers or transformers), got "
                         f"{type(tokenizer).__name__}")
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def sample_rng(seed: int, *parts: object) -> random.Random:
    """A Random seeded by (seed, parts) through sha256: the same sample whatever order it is made in."""
    key = "\0".join(str(p) for p in (seed,) + parts)
    return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))


class TokenPieces:
    """Token lists of the fixed pieces, encoded once per tokenizer."""

    def __init__(self, encode: Encode) -> None:
        self.encode = encode
        self.noise = encode(NOISE)
        if not self.noise:
            raise ValueError("the tokenizer encodes the noise paragraph to no tokens")
        self._cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = self.encode(text)
        return self._cache[text]


def _haystack(pieces: TokenPieces, n_tokens: int, needles: Sequence[tuple[float, list[int]]]) -> tuple[list[int], list[int]]:
    """Noise of `n_tokens` tokens with each needle (depth, ids) inserted at a paragraph boundary.

    Returns (ids, start of each needle in ids).  The noise is cut at its end so the total is
    exact; needles at the same boundary keep their given order."""
    unit = pieces.noise
    n_noise = n_tokens - sum(len(ids) for _, ids in needles)
    if n_noise < 0:
        raise ValueError(f"the needles need {n_tokens - n_noise} tokens, more than the {n_tokens} left for the haystack")
    n_units = -(-n_noise // len(unit))  # paragraphs, the last one cut
    slots = []
    for i, (depth, _) in enumerate(needles):
        b = min(n_units, max(0, round(depth * n_noise / len(unit))))
        if b * len(unit) > n_noise:  # a slot past the cut noise: the end
            b = n_units
        slots.append((b, i))
    out: list[int] = []
    starts = [0] * len(needles)
    order = sorted(slots)
    k = 0
    noise_left = n_noise
    for b in range(n_units + 1):
        while k < len(order) and order[k][0] == b:
            starts[order[k][1]] = len(out)
            out.extend(needles[order[k][1]][1])
            k += 1
        if b < n_units:
            take = min(len(unit), noise_left)
            out.extend(unit[:take])
            noise_left -= take
    return out, starts


def _assemble(pieces: TokenPieces, length: int, intro: str, needles: Sequence[tuple[float, str]], question: str,
              answer: str) -> tuple[list[int], int, list[int], tuple[int, int]]:
    """intro + haystack(with needles) + question + answer, exactly `length` tokens.

    Returns (ids, answer_start, needle starts in ids, haystack range)."""
    head, q_ids, a_ids = pieces(intro), pieces(question), pieces(answer)
    needle_ids = [(d, pieces(t)) for d, t in needles]
    fixed = len(head) + len(q_ids) + len(a_ids)
    n_hay = length - fixed
    need = sum(len(ids) for _, ids in needle_ids)
    if n_hay < need:
        raise ValueError(f"length={length} is too short for this task: it needs at least {fixed + need} tokens")
    hay, starts = _haystack(pieces, n_hay, needle_ids)
    ids = head + hay + q_ids + a_ids
    assert len(ids) == length
    return ids, len(head) + len(hay) + len(q_ids), [len(head) + s for s in starts], (len(head), len(head) + len(hay))


def _two_words(rng: random.Random, n: int) -> list[str]:
    pairs = [f"{a}-{b}" for a in _ADJ for b in _NOUN]
    return rng.sample(pairs, n)


def _var_names(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        v = "".join(rng.choice(_UPPER) for _ in range(5))
        if v not in names and v not in _VT_EXAMPLE_NAMES:
            names.append(v)
    return names


def _check_common(task: str, length: int, depth: float, index: int) -> None:
    if task not in RETRIEVAL_TASKS:
        raise ValueError(f"task must be one of {RETRIEVAL_TASKS}, got {task!r}")
    if not isinstance(length, int) or isinstance(length, bool) or length < 16:
        raise ValueError(f"length must be an integer >= 16, got {length!r}")
    if not (isinstance(depth, (int, float)) and 0.0 <= float(depth) <= 1.0):
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be a non-negative integer, got {index!r}")


def make_sample(tokenizer: Any, task: str, length: int, depth: float, index: int, *, seed: int = 0,
                num_needles: int = 4, hops: int = 4, pieces: Any = None) -> Sample:
    """Sample `index` of `task` at `length` tokens with its (target) needle at `depth`.

    Deterministic in (seed, task, length, depth, index).  `num_needles` (niah) counts the target;
    `hops` (vt) is the number of assignments after the first (so hops + 1 variables)."""
    _check_common(task, length, depth, index)
    depth = float(depth)
    pieces = pieces if isinstance(pieces, TokenPieces) else TokenPieces(encoder(tokenizer))
    rng = sample_rng(seed, task, length, f"{depth:.6f}", index)
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key.\n"
        ids, a0, starts, hay = _assemble(pieces, length, PASSKEY_INTRO, [(depth, needle)],
                                         "\nWhat is the pass key? The pass key is", f" {key}")
        return Sample(task, length, depth, index, ids, a0, f" {key}", starts[0], hay, {"key": key})
    if task == "niah":
        if not isinstance(num_needles, int) or num_needles < 1:
            raise ValueError(f"num_needles must be a positive integer, got {num_needles!r}")
        keys = _two_words(rng, num_needles)
        values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
        depths = [depth] + [rng.random() for _ in keys[1:]]
        needles = [(d, f"One of the special magic numbers for {k} is: {v}.\n") for d, k, v in zip(depths, keys, values)]
        q = (f"\nWhat is the special magic number for {keys[0]} mentioned in the provided text?\n"
             f"The special magic number for {keys[0]} mentioned in the provided text is:")
        ids, a0, starts, hay = _assemble(pieces, length, NIAH_INTRO, needles, q, f" {values[0]}")
        return Sample(task, length, depth, index, ids, a0, f" {values[0]}", starts[0], hay,
                      {"key": keys[0], "value": values[0], "distractors": dict(zip(keys[1:], values[1:]))})
    if not isinstance(hops, int) or hops < 1:
        raise ValueError(f"hops must be a positive integer, got {hops!r}")
    names = _var_names(rng, hops + 1)
    value = str(rng.randint(10000, 99999))
    stmts = [f"VAR {names[0]} = {value}.\n"] + [f"VAR {b} = VAR {a}.\n" for a, b in zip(names[:-1], names[1:])]
    depths = [depth + (1.0 - depth) * i / len(stmts) for i in range(len(stmts))]
    q = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above.\n"
         f"Answer: According to the chain(s) of variable assignment in the text above, {len(names)} variables "
         f"are assigned the value {value}, they are:")
    answer = " " + " ".join(names)
    ids, a0, starts, hay = _assemble(pieces, length, VT_INTRO, list(zip(depths, stmts)), q, answer)
    return Sample(task, length, depth, index, ids, a0, answer, starts[0], hay,
                  {"value": value, "variables": names, "statement_pos": starts})


def make_samples(tokenizer: Any, task: str, length: int, depth: float, n: int, *, seed: int = 0,
                 **kwargs: Any) -> list[Sample]:
    """Samples 0 .. n - 1 of (task, length, depth): `make_sample` with one shared tokenization cache."""
    pieces = TokenPieces(encoder(tokenizer))
    return [make_sample(None, task, length, depth, i, seed=seed, pieces=pieces, **kwargs) for i in range(n)]
