"""multihop_search: tool use - answer multi-hop questions about an invented world by calling `search` and `open`.

A multi-hop search task in the spirit of Search-R1, offline: the knowledge base is an encyclopedia of
fictional people, cities, companies, rivers, countries and mountains, named from random syllables so
that no model knows the answers by heart. Each entity is one document ("d0042"): a title and a few
sentences stating its relations ("Varo Lentis is a baker born in Quellmar. Varo Lentis works for
Tessiq Works."). A question chains one to `hops` relations from a named entity, such as "What is the
birthplace of the founder of Tessiq Works?", and its answer is an entity's name.

Tools (bound methods; rlcli builds their JSON schemas from the type hints and docstrings, runs the
calls the model makes and sends the results back as `tool` messages, without calling step):
- `search(query)`: the 3 best documents by BM25, one line each, "d0042: <title>: <first sentence>".
- `open(doc_id)`: the whole document, or an error line for an unknown id.
With `python_tools: false` the env offers none: serve the same tools over MCP instead, with
`env.mcp_servers: [{command: [python, -m, rlcli.envs.search_server, --corpus-seed, N, --corpus-size, M]}]`.

The model answers with `<answer>NAME</answer>`, which ends the episode: reward 1.0 for the right
name (case and spacing do not count), info {"success": bool}. A reply with neither an answer nor
a tool call gets a reminder, and the episode goes on.

Expert: it knows the question's chain and looks each hop up, one tool call per turn in the
Hermes/Qwen format: search the hop's entity by name, open its document, then the next hop; finally
the answer. Tool results do not pass through step, so the expert follows this plan, not the results.

kwargs: `corpus_seed` (0) and `corpus_size` (300 entities) make the corpus; `hops` (3) is the most
hops a question has (the task seed picks 1 to hops); `python_tools` (true).
"""

from __future__ import annotations

import functools
import math
import random
import re
from collections import Counter
from dataclasses import dataclass, field

from rlcli.envs.parsing import parse_answer_tag
from rlcli.envs.tool_calls import hermes_tool_call

# Syllables such as "quel" or "ti": two or three of them make a word.
SYLLABLES = [
    onset + vowel + coda
    for onset in ["b", "d", "k", "l", "m", "n", "qu", "r", "s", "t", "th", "v", "z"]
    for vowel in "aeiou"
    for coda in ["", "l", "n", "r"]
]
# What share of the corpus each kind of entity takes; people take the rest.
SHARES = {"country": 0.06, "mountain": 0.06, "river": 0.08, "city": 0.2, "company": 0.2}
MIN_CORPUS_SIZE = 20  # below this some kinds would have no entity at all
PROFESSIONS = ["a baker", "a painter", "an engineer", "a sailor", "a teacher", "a doctor", "an architect", "a poet"]
INDUSTRIES = ["shipping", "textile", "mining", "software", "brewing", "glassmaking", "publishing"]
COMPANY_SUFFIXES = ["Works", "Holdings", "Labs", "Foundry", "Trading", "Mills", "Group"]
# The relations a question can chain, each a function of its subject (one answer):
# relation -> (subject kinds, object kind, the noun phrase that names the object).
RELATIONS = {
    "born_in": ({"person"}, "city", "the birthplace of {}"),
    "works_for": ({"person"}, "company", "the employer of {}"),
    "founder": ({"company"}, "person", "the founder of {}"),
    "headquarters": ({"company"}, "city", "the city where {} is headquartered"),
    "country": ({"city", "mountain"}, "country", "the country of {}"),
    "river": ({"city"}, "river", "the river that flows through {}"),
    "capital": ({"country"}, "city", "the capital of {}"),
    "source": ({"river"}, "mountain", "the mountain where {} rises"),
}
SEARCH_RESULTS = 3
SYSTEM = (
    "Answer the question about an invented world; you cannot know the facts, so look them up. "
    "Tools: search(query) lists matching documents, open(doc_id) shows a whole document. "
    "When you know the answer, reply with <answer>NAME</answer>."
)
REMINDER = "Look things up with the search and open tools, then reply with <answer>NAME</answer>."


def tokenize(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.casefold())


def normalise(text: str) -> str:
    """Case and spacing do not count: ' varo  lentis' matches 'Varo Lentis'."""
    return " ".join(text.split()).casefold()


class BM25:
    """Okapi BM25 ranking of tokenised documents, with the usual k1 = 1.5 and b = 0.75."""

    def __init__(self, texts: list[str], k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self.counts = [Counter(tokenize(text)) for text in texts]
        self.lengths = [sum(counts.values()) for counts in self.counts]
        self.mean_length = sum(self.lengths) / max(len(texts), 1)
        frequency = Counter(token for counts in self.counts for token in counts)
        # The +1 inside the log keeps the weight of a token found in most documents positive.
        self.idf = {t: math.log(1 + (len(texts) - n + 0.5) / (n + 0.5)) for t, n in frequency.items()}

    def scores(self, query: str) -> list[float]:
        tokens = [t for t in tokenize(query) if t in self.idf]
        out = []
        for counts, length in zip(self.counts, self.lengths):
            norm = self.k1 * (1 - self.b + self.b * length / self.mean_length)
            out.append(sum(self.idf[t] * counts[t] * (self.k1 + 1) / (counts[t] + norm) for t in tokens if t in counts))
        return out

    def top(self, query: str, k: int) -> list[int]:
        """The indices of the k best documents that share a token with the query, best first (ties: lower index)."""
        scores = self.scores(query)
        ranked = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: (-scores[i], i))
        return ranked[:k]


@dataclass(frozen=True)
class Document:
    doc_id: str
    kind: str  # person, city, company, river, country or mountain
    title: str  # the entity's name
    sentences: tuple[str, ...]
    relations: dict[str, str]  # relation (a key of RELATIONS) -> the doc_id of its object

    def text(self) -> str:
        return f"{self.doc_id}: {self.title}\n" + " ".join(self.sentences)


@dataclass
class Corpus:
    documents: list[Document]
    by_id: dict[str, Document] = field(init=False)
    index: BM25 = field(init=False)

    def __post_init__(self) -> None:
        self.by_id = {doc.doc_id: doc for doc in self.documents}
        self.index = BM25([f"{doc.title} {' '.join(doc.sentences)}" for doc in self.documents])

    def search(self, query: str, k: int = SEARCH_RESULTS) -> list[Document]:
        return [self.documents[i] for i in self.index.top(query, k)]


class _Names:
    """Invented names whose words are all distinct, so a name's words point to its own document."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def word(self, suffix: str = "") -> str:
        while True:
            word = "".join(self.rng.choice(SYLLABLES) for _ in range(self.rng.randint(2, 3))).capitalize() + suffix
            if word.casefold() not in self.used:
                self.used.add(word.casefold())
                return word

    def name(self, kind: str) -> str:
        if kind == "person":
            return f"{self.word()} {self.word()}"
        if kind == "company":
            return f"{self.word()} {self.rng.choice(COMPANY_SUFFIXES)}"
        if kind == "river":
            return f"{self.word()} River"
        if kind == "mountain":
            return f"Mount {self.word()}"
        if kind == "country":
            return self.word(self.rng.choice(["ia", "land"]))
        return self.word()  # a city


@functools.lru_cache(maxsize=8)
def corpus(seed: int, size: int) -> Corpus:
    """The encyclopedia of `size` entities made from `seed`: the same seed and size, the same documents."""
    if size < MIN_CORPUS_SIZE:
        raise ValueError(f"corpus_size must be at least {MIN_CORPUS_SIZE}, got {size}")
    rng = random.Random(seed)
    counts = {kind: max(1, int(size * share)) for kind, share in SHARES.items()}
    counts["person"] = size - sum(counts.values())
    kinds = [kind for kind, n in counts.items() for _ in range(n)]
    rng.shuffle(kinds)  # so a doc id says nothing about its entity's kind
    names = _Names(rng)
    title = [names.name(kind) for kind in kinds]
    of_kind = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in counts}
    relations: list[dict[str, int]] = [{} for _ in kinds]
    countries, cities = of_kind["country"], of_kind["city"]
    for j, city in enumerate(cities):
        # The first cities are the capitals, one per country, so each capital lies in its own country.
        country = countries[j] if j < len(countries) else rng.choice(countries)
        if j < len(countries):
            relations[country]["capital"] = city
        relations[city]["country"] = country
        relations[city]["river"] = rng.choice(of_kind["river"])
    for river in of_kind["river"]:
        relations[river]["source"] = rng.choice(of_kind["mountain"])
    for mountain in of_kind["mountain"]:
        relations[mountain]["country"] = rng.choice(countries)
    for company in of_kind["company"]:
        relations[company]["founder"] = rng.choice(of_kind["person"])
        relations[company]["headquarters"] = rng.choice(cities)
    for person in of_kind["person"]:
        relations[person]["born_in"] = rng.choice(cities)
        relations[person]["works_for"] = rng.choice(of_kind["company"])

    founded: dict[int, list[int]] = {}
    on_river: dict[int, list[int]] = {}
    for i, objects in enumerate(relations):
        if "founder" in objects:
            founded.setdefault(objects["founder"], []).append(i)
        if "river" in objects:
            on_river.setdefault(objects["river"], []).append(i)
    documents = []
    for i, kind in enumerate(kinds):
        rel = {r: title[j] for r, j in relations[i].items()}
        name = title[i]
        if kind == "person":
            sentences = [
                f"{name} is {rng.choice(PROFESSIONS)} born in {rel['born_in']}.",
                f"{name} works for {rel['works_for']}.",
            ] + [f"{name} founded {title[c]}." for c in founded.get(i, [])]
        elif kind == "company":
            sentences = [
                f"{name} is a {rng.choice(INDUSTRIES)} company headquartered in {rel['headquarters']}.",
                f"{name} was founded by {rel['founder']} in {rng.randint(1820, 2015)}.",
                f"{name} employs {rng.randint(12, 9000)} people.",
            ]
        elif kind == "city":
            sentences = [
                f"{name} is a city in {rel['country']}.",
                f"{name} lies on the {rel['river']}.",
                f"{name} has {rng.randint(2, 900) * 1000} inhabitants.",
            ]
        elif kind == "country":
            sentences = [
                f"{name} is a country whose capital is {rel['capital']}.",
                f"{name} covers {rng.randint(5, 600) * 1000} square kilometres.",
            ]
        elif kind == "river":
            sentences = [f"The {name} rises on {rel['source']}.", f"The {name} is {rng.randint(40, 2500)} km long."]
            if i in on_river:
                sentences.append(f"The {name} flows through {', '.join(title[c] for c in on_river[i])}.")
        else:  # a mountain
            sentences = [
                f"{name} is a mountain in {rel['country']}.",
                f"{name} is {rng.randint(800, 6500)} metres high.",
            ]
        doc_rel = {r: f"d{j:04d}" for r, j in relations[i].items()}
        documents.append(Document(f"d{i:04d}", kind, name, tuple(sentences), doc_rel))
    return Corpus(documents)


def sample_chain(encyclopedia: Corpus, rng: random.Random, hops: int) -> tuple[list[Document], list[str]]:
    """A named entity and `hops` relations from it, through distinct entities (so no question
    answers itself): (the documents from the named entity to the answer, the relations)."""
    for _ in range(1000):
        path = [rng.choice(encyclopedia.documents)]
        chain: list[str] = []
        while len(chain) < hops:
            seen = {doc.doc_id for doc in path}
            options = sorted(r for r, target in path[-1].relations.items() if target not in seen)
            if not options:
                break
            chain.append(rng.choice(options))
            path.append(encyclopedia.by_id[path[-1].relations[chain[-1]]])
        if len(chain) == hops:
            return path, chain
    raise ValueError(f"found no chain of {hops} distinct hops in this corpus")


class MultihopSearch:
    def __init__(self, corpus_seed: int = 0, corpus_size: int = 300, hops: int = 3, python_tools: bool = True):
        if hops < 1:
            raise ValueError(f"hops must be at least 1, got {hops}")
        self.encyclopedia = corpus(corpus_seed, corpus_size)
        self.hops = hops
        self.tools = [self.search, self.open] if python_tools else []

    def search(self, query: str) -> str:
        """Search the encyclopedia: the 3 best matching documents, one per line as "id: title: first sentence".

        Args:
            query: Words to look for, such as a name.
        """
        hits = self.encyclopedia.search(query)
        if not hits:
            return f"No document matches {query!r}."
        return "\n".join(f"{doc.doc_id}: {doc.title}: {doc.sentences[0]}" for doc in hits)

    def open(self, doc_id: str) -> str:
        """Open a document of the encyclopedia: its id, title and full text.

        Args:
            doc_id: The document's id as search lists it, such as d0042.
        """
        doc = self.encyclopedia.by_id.get(doc_id.strip().casefold())
        if doc is None:
            return f"Error: there is no document {doc_id!r}; search for the ids."
        return doc.text()

    def reset(self, seed: int) -> tuple[list[dict], dict]:
        rng = random.Random(seed)
        path, chain = sample_chain(self.encyclopedia, rng, rng.randint(1, self.hops))
        phrase = f"the {path[0].title}" if path[0].kind == "river" else path[0].title  # the Kirzar River
        for relation in chain:
            phrase = RELATIONS[relation][2].format(phrase)
        question = f"{'Who' if path[-1].kind == 'person' else 'What'} is {phrase}?"
        self.answer = path[-1].title
        # The expert's plan: look each hop's entity up (search it by name, open its document), then answer.
        self.plan = [
            call
            for doc in path[:-1]
            for call in (
                hermes_tool_call("search", {"query": doc.title}),
                hermes_tool_call("open", {"doc_id": doc.doc_id}),
            )
        ] + [f"<answer>{self.answer}</answer>"]
        self.expert_turns = 0
        task = {"question": question, "answer": self.answer, "hops": len(chain), "chain": [d.doc_id for d in path]}
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], {"task": task}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        answer = parse_answer_tag(action)
        if answer is None:
            return REMINDER, 0.0, False, False, {}
        correct = normalise(answer) == normalise(self.answer)
        feedback = "Correct." if correct else f"Wrong, the answer is {self.answer}."
        return feedback, float(correct), True, False, {"success": correct}

    def expert_action(self) -> str:
        """The plan's next action; past its end, the answer again."""
        action = self.plan[min(self.expert_turns, len(self.plan) - 1)]
        self.expert_turns += 1
        return action


def make_env(corpus_seed: int = 0, corpus_size: int = 300, hops: int = 3, python_tools: bool = True) -> MultihopSearch:
    return MultihopSearch(corpus_seed, corpus_size, hops, python_tools)
