"""Small stand-ins for RULER's data files (the essays, the word lists, SQuAD and HotpotQA JSON),
written with the names `msakit.eval.ruler.RulerData` looks for, and a sentence splitter."""

from __future__ import annotations

import json
import re
from pathlib import Path

ESSAY = ("April 2012. A startup is a company designed to grow fast. Being newly founded does not in itself make a "
         "company a startup. Nor is it necessary for a startup to work on technology, or take venture funding. "
         "The only essential thing is growth! Everything else we associate with startups follows from growth? "
         "If you want to start one it's important to understand that. ")
NOUNS = ["anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quartz", "river", "saddle", "tunnel"]
ADJS = ["amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively"]
VERBS = ["run", "jump", "write", "read", "sing", "swim", "build", "carry", "draw", "fold", "grow", "hold"]


def squad() -> dict:
    def para(i: int, art: int) -> dict:
        ctx = f"Paragraph {art}-{i} tells that the capital of region {art}{i} is City{art}{i}."
        return dict(context=ctx, qas=[
            dict(question=f"What is the capital of region {art}{i}?", is_impossible=False,
                 answers=[dict(text=f"City{art}{i}"), dict(text=f"city{art}{i}")]),
            dict(question="Unanswerable?", is_impossible=True, answers=[])])
    return dict(data=[dict(title=f"A{a}", paragraphs=[para(i, a) for i in range(4)]) for a in range(6)])


def hotpotqa() -> list:
    out = []
    for q in range(8):
        out.append(dict(question=f"Which river runs through town {q}?", answer=f"River{q}",
                        context=[[f"Town {q}", [f"Town {q} lies on River{q}.", " It is small."]],
                                 [f"Other {q}", [f"Other place {q} has no river."]]]))
    return out


def write_ruler_data(folder: Path) -> Path:
    """The six files in `folder` (the essays repeated to about 6K words)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "PaulGrahamEssays.json").write_text(json.dumps(dict(text=ESSAY * 120)))
    (folder / "nounlist.txt").write_text("\n".join(NOUNS) + "\n")
    (folder / "adjectivelist.txt").write_text("\n".join(ADJS) + "\n")
    (folder / "verblist.txt").write_text("\n".join(VERBS) + "\n")
    (folder / "squad.json").write_text(json.dumps(squad()))
    (folder / "hotpotqa.json").write_text(json.dumps(hotpotqa()))
    return folder


def split_sentences(text: str) -> list[str]:
    """Sentences end at . ! ? before a space (enough for the stand-in essays)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]
