"""Synthetic encyclopedia and multi-hop questions for the embedded default of the search task.

A fictional world of people, cities, countries, organisations and written works, with random facts,
rendered as short wiki-style passages, plus questions whose answers can only be found by searching
those passages. The files use the formats of real data, so a user swaps in wiki-18 and
NQ/HotpotQA by changing a path:
- `corpus.jsonl`: `{"id": "17", "contents": "\\"Title\\"\\ntext"}` per passage (Search-R1's format).
  An entity's passages are consecutive and share its title: together they are its page.
- `{warmstart,train,dev,test}.jsonl`: `{"id", "question", "answer": [aliases], "golden_answers":
  [aliases], "hops": k, "support": [passage id per hop], "hop_queries": [search query per hop],
  "hop_answers": [answer after each hop]}`; `answer`/`golden_answers` are what ASearcher/Search-R1
  training files carry, the hop fields let the training script write successful demonstrations.

Made for a model of a few million parameters: passages of one sentence, names built from a fixed
list of syllables (a small BPE learns them), eleven question templates over seven relations, and
mostly 1-2 hop questions (50% 1 hop, 35% 2, 10% 3, 5% 4). Distractors: about a fifth of the
entities have a twin whose name differs in one syllable, and person first names are shared.

Splits come from one `num_questions` budget: warmstart 10%, dev 3%, test 5%, train the rest
(1000/300/500/8200 for the default 10k). The warmstart questions are about a separate part of the
world (about a tenth of the entities, with no relation to the rest), so the SFT demonstrations
never show a fact that train/dev/test ask about. No question text appears in two splits. Same seed
and sizes give byte-identical files.
"""
import json
import os
import random

from lib.cache import build_once, cache_root

# Bump when the generator changes, so cached data built by an older version is not reused.
GENERATOR_VERSION = 2

SPLITS = ("warmstart", "train", "dev", "test")
SPLIT_FRACTIONS = {"warmstart": 0.10, "dev": 0.03, "test": 0.05}  # train: the rest
HOP_WEIGHTS = {1: 0.50, 2: 0.35, 3: 0.10, 4: 0.05}
WARMSTART_WORLD_FRACTION = 0.1
TWIN_PROBABILITY = 0.2

SYLLABLES = ["ka", "ri", "lo", "ven", "mor", "esk", "il", "van", "tar", "qua", "bel", "dor", "sa", "min",
             "tu", "rel", "ga", "nor", "pe", "lis", "vo", "ran", "zel", "ko", "ma", "thi", "ul", "den",
             "fa", "ros", "ne", "bri", "ha", "sol", "te", "vik", "ar", "lun", "ci", "gor"]
OCCUPATIONS = ["painter", "poet", "sailor", "farmer", "judge", "doctor", "singer", "merchant", "builder",
               "teacher", "soldier", "baker"]
ORG_KINDS = ["Guild", "Society", "Company", "Academy", "Order", "League", "Club", "Circle"]
WORK_NOUNS = ["Song", "Tale", "Chronicle", "Letters", "Garden", "Voyage", "Mirror", "River", "Lantern", "Winter"]
WORK_KINDS = ["novel", "poem", "play", "book"]
CITY_FEATURES = ["bridges", "markets", "gardens", "towers", "harbour", "mills", "fountains", "walls"]
HOBBIES = ["kind letters to friends", "long walks", "old songs", "fine horses", "sharp jokes", "rare stamps"]
COUNTRY_LANDS = ["hills", "lakes", "forests", "plains", "mountains", "islands", "rivers", "deserts"]

# Entity passages per kind, in page order. Each fact passage holds exactly one relation (plus the
# attribute asked with it), so every hop has a single supporting passage.
PASSAGES = {
    "person": ["intro", "born", "member"],
    "org": ["intro", "founded", "based"],
    "work": ["written"],
    "city": ["intro", "located"],
    "country": ["intro", "capital"],
}
# Share of entities per kind (before scaling to the passage budget).
KIND_SHARES = {"person": 3500, "org": 700, "work": 1500, "city": 800, "country": 40}

# relation: (subject kind, object kind or None for an attribute, passage holding it,
#            question for the last hop, noun phrase when it is an inner hop, search query)
RELATIONS = {
    "born_in": ("person", "city", "born", "Where was {x} born?", "the birthplace of {x}", "where was {x} born"),
    "birth_year": ("person", None, "born", "When was {x} born?", None, "when was {x} born"),
    "occupation": ("person", None, "intro", "What is the occupation of {x}?", None, "{x} occupation"),
    "member_of": ("person", "org", "member", "Which group is {x} a member of?", "the group of {x}",
                  "{x} member of"),
    "founded_by": ("org", "person", "founded", "Who founded {x}?", "the founder of {x}", "who founded {x}"),
    "founding_year": ("org", None, "founded", "When was {x} founded?", None, "when was {x} founded"),
    "based_in": ("org", "city", "based", "Where is {x} based?", "the home city of {x}", "where is {x} based"),
    "written_by": ("work", "person", "written", "Who wrote {x}?", "the author of {x}", "{x} written by"),
    "written_year": ("work", None, "written", "When was {x} written?", None, "when was {x} written"),
    "located_in": ("city", "country", "located", "Which country is {x} in?", "the country of {x}",
                   "which country is {x} in"),
    "capital": ("country", "city", "capital", "What is the capital of {x}?", "the capital of {x}",
                "capital of {x}"),
}


# --- names ---
def _word(rng: random.Random, num_syllables: int) -> list[str]:
    return [rng.choice(SYLLABLES) for _ in range(num_syllables)]


def _new_name(rng: random.Random, kind: str, first_names: list[list[str]]) -> list[list[str]]:
    """A name as words of syllables; the last word of org/work names is an English noun."""
    if kind == "person":
        return [rng.choice(first_names), _word(rng, rng.choice((2, 3)))]
    if kind == "city":
        return [_word(rng, rng.choice((2, 3)))]
    if kind == "country":
        return [_word(rng, 2) + [rng.choice(["ia", "land", "mark"])]]
    if kind == "org":
        return [_word(rng, rng.choice((2, 3))), [rng.choice(ORG_KINDS).lower()]]
    return [["the"], _word(rng, rng.choice((2, 3))), [rng.choice(WORK_NOUNS).lower()]]


def _twin_of(rng: random.Random, kind: str, name: list[list[str]]) -> list[list[str]]:
    """A similar name: one syllable of the distinctive word replaced."""
    index = {"person": 1, "city": 0, "country": 0, "org": 0, "work": 1}[kind]
    word = list(name[index])
    pos = rng.randrange(len(word) - (1 if kind == "country" else 0))
    word[pos] = rng.choice([s for s in SYLLABLES if s != word[pos]])
    return name[:index] + [word] + name[index + 1:]


def _make_names(rng: random.Random, kind: str, count: int, taken: set[str]) -> list[str]:
    # Few first names, so that many people share one: BM25 must rely on the whole name.
    first_names = [_word(rng, 2) for _ in range(max(20, count // 25))]
    names, parts = [], []
    attempts = 0
    while len(names) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(f"could not draw {count} distinct {kind} names; lower num_passages")
        if parts and rng.random() < TWIN_PROBABILITY:
            words = _twin_of(rng, kind, rng.choice(parts))
        else:
            words = _new_name(rng, kind, first_names)
        text = " ".join("".join(w).capitalize() if w != ["the"] else "The" for w in words)
        if text.lower() in taken:
            continue
        taken.add(text.lower())
        names.append(text)
        parts.append(words)
    return names


# --- world ---
def _make_world(rng: random.Random, counts: dict[str, int], taken: set[str],
                names: dict[str, list[str]] | None = None) -> dict:
    """Entities with their facts. Relations only point inside this world. `names`: use these names
    (per kind) instead of drawing new ones."""
    if names is None:
        names = {kind: _make_names(rng, kind, counts[kind], taken) for kind in KIND_SHARES}
    ents = {kind: [{"kind": kind, "name": n} for n in names[kind]] for kind in KIND_SHARES}
    for country in ents["country"]:
        country["land"] = rng.choice(COUNTRY_LANDS)
    cities_of = {country["name"]: [] for country in ents["country"]}
    for i, city in enumerate(ents["city"]):
        city["feature"] = rng.choice(CITY_FEATURES)
        # The first cities go one to each country, so every country has a capital located in it.
        country = ents["country"][i] if i < len(ents["country"]) else rng.choice(ents["country"])
        city["located_in"] = country
        cities_of[country["name"]].append(city)
    for country in ents["country"]:
        country["capital"] = rng.choice(cities_of[country["name"]])
    for person in ents["person"]:
        person["occupation"] = rng.choice(OCCUPATIONS)
        person["born_in"] = rng.choice(ents["city"])
        person["birth_year"] = str(rng.randint(1700, 1990))
        person["member_of"] = rng.choice(ents["org"])
        person["hobby"] = rng.choice(HOBBIES)
    for org in ents["org"]:
        org["founded_by"] = rng.choice(ents["person"])
        org["founding_year"] = str(rng.randint(1600, 1990))
        org["based_in"] = rng.choice(ents["city"])
        org["org_kind"] = org["name"].split()[-1].lower()
    for work in ents["work"]:
        work["written_by"] = rng.choice(ents["person"])
        work["written_year"] = str(rng.randint(1750, 2000))
        work["work_kind"] = rng.choice(WORK_KINDS)
    return ents


def _passage_text(ent: dict, which: str) -> str:
    n = ent["name"]
    return {
        ("person", "intro"): lambda: f"{n} is a {ent['occupation']} by occupation.",
        ("person", "born"): lambda: f"{n} was born in {ent['born_in']['name']} in {ent['birth_year']}.",
        ("person", "member"): lambda: f"{n} is a member of {ent['member_of']['name']}.",
        ("person", "extra"): lambda: f"{n} is known for {ent['hobby']}.",
        ("org", "intro"): lambda: f"{n} is a {ent['org_kind']} of people who meet every year.",
        ("org", "founded"): lambda: f"{n} was founded by {ent['founded_by']['name']} in {ent['founding_year']}.",
        ("org", "based"): lambda: f"{n} is based in {ent['based_in']['name']}.",
        ("work", "written"): lambda: (f"{n} is a {ent['work_kind']} written by {ent['written_by']['name']} "
                                      f"in {ent['written_year']}."),
        ("city", "intro"): lambda: f"{n} is known for its {ent['feature']}.",
        ("city", "located"): lambda: f"{n} is a city in the country of {ent['located_in']['name']}.",
        ("country", "intro"): lambda: f"{n} is a land of {ent['land']}.",
        ("country", "capital"): lambda: f"The capital of {n} is {ent['capital']['name']}.",
    }[(ent["kind"], which)]()


def _scaled_counts(num_passages: float) -> dict[str, int]:
    per_unit = sum(KIND_SHARES[k] * len(PASSAGES[k]) for k in KIND_SHARES)
    scale = num_passages / per_unit
    counts = {k: max(3, int(KIND_SHARES[k] * scale)) for k in KIND_SHARES}
    # The floor of 3 per kind can overshoot a tiny budget: take the excess from the people.
    while sum(n * len(PASSAGES[k]) for k, n in counts.items()) > num_passages and counts["person"] > 3:
        counts["person"] -= 1
    return counts


# --- questions ---
def _aliases(ent_or_value) -> list[str]:
    if isinstance(ent_or_value, str):
        return [ent_or_value]
    name, kind = ent_or_value["name"], ent_or_value["kind"]
    if kind == "person":
        return [name, name.split()[-1]]
    if kind == "org":
        return [name, name.rsplit(" ", 1)[0]]
    if kind == "city":
        return [name, f"{name} City", f"City of {name}"]
    if kind == "work":
        return [name, name[len("The "):]]
    return [name]


def _walk(rng: random.Random, start: dict, hops: int) -> list[str] | None:
    """Relations of a chain of `hops` facts from `start` that never revisits an entity."""
    chain, ent, seen = [], start, {id(start)}
    for hop in range(hops):
        last = hop == hops - 1
        options = [r for r, spec in RELATIONS.items() if spec[0] == ent["kind"] and (last or spec[1])]
        if last and rng.random() < 0.6:  # prefer entity answers; attributes make numbers the answer
            options = [r for r in options if RELATIONS[r][1]] or options
        rng.shuffle(options)
        for rel in options:
            nxt = ent[rel]
            if isinstance(nxt, str) or id(nxt) not in seen:
                break
        else:
            return None
        chain.append(rel)
        if isinstance(nxt, dict):
            seen.add(id(nxt))
            ent = nxt
    return chain


def _make_question(rng: random.Random, ents: dict, hops: int, passage_ids: dict) -> dict | None:
    kind = rng.choices(list(KIND_SHARES), weights=[3, 2, 2, 2, 1])[0]
    start = rng.choice(ents[kind])
    chain = _walk(rng, start, hops)
    if chain is None:
        return None
    phrase, ent = start["name"], start
    support, hop_queries, hop_answers = [], [], []
    for i, rel in enumerate(chain):
        _, _, passage, final, inner, query = RELATIONS[rel]
        support.append(passage_ids[(id(ent), passage)])
        hop_queries.append(query.format(x=ent["name"]))
        ent = ent[rel]
        hop_answers.append(ent if isinstance(ent, str) else ent["name"])
        phrase = final.format(x=phrase) if i == len(chain) - 1 else inner.format(x=phrase)
    question = phrase[0].upper() + phrase[1:]
    answer = _aliases(ent)
    return {"question": question, "answer": answer, "golden_answers": answer, "hops": hops,
            "support": support, "hop_queries": hop_queries, "hop_answers": hop_answers}


def _draw_questions(rng: random.Random, ents: dict, count: int, passage_ids: dict, seen: set[str],
                    hop_weights: dict[int, float]) -> list[dict]:
    out, attempts = [], 0
    while len(out) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise ValueError(f"could not draw {count} distinct questions; raise num_passages or lower num_questions")
        hops = rng.choices(list(hop_weights), weights=list(hop_weights.values()))[0]
        q = None
        # Long chains fail more often (dead ends); retrying at the same length keeps the hop mix.
        for _ in range(100):
            q = _make_question(rng, ents, hops, passage_ids)
            if q is not None and q["question"] not in seen:
                break
        if q is None or q["question"] in seen:
            continue
        seen.add(q["question"])
        out.append(q)
    return out


def split_sizes(num_questions: int) -> dict[str, int]:
    sizes = {s: round(num_questions * f) for s, f in SPLIT_FRACTIONS.items()}
    sizes["train"] = num_questions - sum(sizes.values())
    return sizes


# --- build ---
def _make_worlds(rng: random.Random, num_passages: int, names: dict[str, dict[str, list[str]]] | None = None) -> dict:
    """The warm-start world (a tenth of the passages) and the main world, drawn from `rng` in that
    order. `names`: per part and kind, the names to use instead of drawing new ones."""
    names, taken = names or {}, set()
    warm_counts = _scaled_counts(num_passages * WARMSTART_WORLD_FRACTION)
    warm_passages = sum(n * len(PASSAGES[kind]) for kind, n in warm_counts.items())
    return {"warmstart": _make_world(rng, warm_counts, taken, names.get("warmstart")),
            "main": _make_world(rng, _scaled_counts(num_passages - warm_passages), taken, names.get("main"))}


def _world_names(seed: int, num_passages: int) -> dict[str, dict[str, list[str]]]:
    """The entity names (per world part, per kind) that `build_wiki_data` draws for `seed`."""
    worlds = _make_worlds(random.Random(seed), num_passages)
    return {part: {kind: [e["name"] for e in ents[kind]] for kind in KIND_SHARES} for part, ents in worlds.items()}


def build_wiki_data(out_dir: str, seed: int = 0, num_passages: int = 20000,
                    num_questions: int = 10000, names_seed: int | None = None,
                    hops: tuple[int, ...] = ()) -> dict[str, str]:
    """Write `corpus.jsonl` (exactly `num_passages` passages) and the four question splits into
    `out_dir`; returns {"corpus": path, split: path, ...}.

    `names_seed`: a counterfactual world: the entity names of the world of `names_seed`, with new
    facts, passages and questions drawn from `seed`. Demonstrations over such a world teach the
    embedded model to read answers from search results (the facts differ from the real world's, so
    they cannot be memorised) on exactly the names, hence the tokens, it will meet in training.

    `hops`: the questions' hop counts, drawn uniformly from these (e.g. (2, 3, 4): no question is
    answered by one search); () = the default mix `HOP_WEIGHTS`. The corpus is the same either way."""
    hop_weights = _hop_weights(hops)
    if num_passages < 300:
        raise ValueError(f"num_passages={num_passages} is too small for a world with distractors; use >= 300")
    rng = random.Random(seed)
    worlds = _make_worlds(rng, num_passages, _world_names(names_seed, num_passages) if names_seed is not None else None)

    # Pages in random order; the passage budget is filled with filler passages about random people
    # (they mention the name, so they act as distractors too).
    pages = [(ent, list(PASSAGES[ent["kind"]])) for world in worlds.values() for kind in KIND_SHARES
             for ent in world[kind]]
    num_fixed = sum(len(p) for _, p in pages)
    if num_fixed > num_passages:
        raise ValueError(f"internal: {num_fixed} passages for a budget of {num_passages}")
    people = [page for page in pages if page[0]["kind"] == "person"]
    for _ in range(num_passages - num_fixed):
        rng.choice(people)[1].append("extra")
    rng.shuffle(pages)

    os.makedirs(out_dir, exist_ok=True)
    paths = {"corpus": os.path.join(out_dir, "corpus.jsonl")}
    passage_ids = {}
    with open(paths["corpus"], "w", encoding="utf-8", newline="\n") as f:
        next_id = 0
        for ent, which in pages:
            for w in which:
                pid = str(next_id)
                next_id += 1
                passage_ids.setdefault((id(ent), w), pid)
                contents = f'"{ent["name"]}"\n{_passage_text(ent, w)}'
                f.write(json.dumps({"id": pid, "contents": contents}) + "\n")

    sizes = split_sizes(num_questions)
    seen: set[str] = set()
    records = {"warmstart": _draw_questions(rng, worlds["warmstart"], sizes["warmstart"], passage_ids, seen, hop_weights)}
    # test and dev first, so they stay the same when only the train size changes
    for split in ("test", "dev", "train"):
        records[split] = _draw_questions(rng, worlds["main"], sizes[split], passage_ids, seen, hop_weights)
    for split in SPLITS:
        paths[split] = os.path.join(out_dir, f"{split}.jsonl")
        with open(paths[split], "w", encoding="utf-8", newline="\n") as f:
            for i, q in enumerate(records[split]):
                f.write(json.dumps({"id": f"{split}-{i}", **q}) + "\n")
    return paths


def default_wiki_dir(seed: int = 0, cache_dir: str | None = None, num_passages: int = 20000,
                     num_questions: int = 10000, names_seed: int | None = None, hops: tuple[int, ...] = ()) -> str:
    """The data set under the cache (`$AGENTRL_CACHE`, default ~/.cache/agentrl), built on first use."""
    root = cache_dir or cache_root()
    _hop_weights(hops)  # a bad hop count is refused before anything is built
    names = "" if names_seed is None else f"-names{names_seed}"
    hop_mix = "" if not hops else "-hops" + "".join(str(h) for h in sorted(set(hops)))
    out_dir = os.path.join(root, f"wiki-data-v{GENERATOR_VERSION}-seed{seed}{names}-p{num_passages}-q{num_questions}{hop_mix}")
    return build_once(out_dir, lambda tmp: build_wiki_data(tmp, seed=seed, num_passages=num_passages,
                                                           num_questions=num_questions, names_seed=names_seed, hops=hops))


def parse_hops(text) -> tuple[int, ...]:
    """`"2,3,4"` (or the tuple a command line makes of it) -> (2, 3, 4); `""` -> () (the default mix)."""
    if isinstance(text, (tuple, list, int)):
        text = ",".join(str(h) for h in (text if isinstance(text, (tuple, list)) else [text]))
    try:
        return tuple(int(h) for h in str(text).replace(" ", "").strip("()[]").split(",") if h)
    except ValueError:
        raise ValueError(f"hops must be comma-separated hop counts such as '2,3,4', got {text!r}") from None


def _hop_weights(hops: tuple[int, ...]) -> dict[int, float]:
    if not hops:
        return HOP_WEIGHTS
    bad = [h for h in hops if h not in HOP_WEIGHTS]
    if bad:
        raise ValueError(f"hop counts must be among {sorted(HOP_WEIGHTS)}, got {list(hops)}")
    return {h: 1.0 for h in sorted(set(hops))}


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_qa(path: str) -> list[dict]:
    """Question rows of a search data set, the gold aliases as a list under `answer` whichever way the
    file has them: ASearcher's `answer` (a string or a list) or Search-R1's `golden_answers`."""
    rows = read_jsonl(path)
    for row in rows:
        gold = row.get("answer", row.get("golden_answers"))
        row["answer"] = [gold] if isinstance(gold, str) else list(gold)
    return rows


def iter_wiki_texts(out_dir: str):
    """Passage texts (titles included) and warmstart/train questions and answers, for training the
    tokenizer. Dev and test questions are left out so that no held-out text shapes the vocabulary
    (their entities are in the corpus anyway)."""
    with open(os.path.join(out_dir, "corpus.jsonl"), encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["contents"]
    for split in ("warmstart", "train"):
        for q in read_jsonl(os.path.join(out_dir, f"{split}.jsonl")):
            yield q["question"]
            yield " ".join(q["hop_queries"])
