"""The synthetic benchmark's text: a closed English vocabulary (no homophone pairs, so spelling
is predictable from sound) and a small grammar producing sentences of 3-12 words; train and test
sentences are disjoint. Deterministic given a seed."""

from __future__ import annotations

import random
from typing import List, Tuple

# --------------------------------------------------------------------------------------------
# 1. Text
# --------------------------------------------------------------------------------------------
# Words are chosen so that no two words in the list sound alike (no to/two, sea/see, ...).
DETERMINERS = "the a this that every some my your his her our one no".split()
NAMES = """
anna peter maria john david sarah thomas emma james lucy oliver sophie daniel grace henry alice
martin laura simon helen robert julia george clara frank nina oscar ella victor rosa walter
linda arthur molly edward diana felix hannah
""".split()
NOUNS = """
man woman child boy girl teacher doctor farmer driver baker painter singer soldier student
king queen captain friend father mother brother sister uncle family neighbor stranger dog cat
horse bird fish rabbit mouse lion tiger monkey sheep goat duck chicken snake spider bear wolf
house garden kitchen window table chair bottle glass plate basket box bag letter book paper pencil
picture clock lamp mirror carpet blanket pillow bed door wall floor roof bridge river lake
mountain forest field village city street market shop school office church castle tower island
beach valley hill stone rock tree apple orange lemon banana bread cheese butter cake soup
coffee milk water sugar salt rice potato tomato carrot onion egg candle hammer knife spoon cup
ship boat train bus car truck bicycle engine wheel ticket money coin ring necklace hat coat
jacket shirt shoe glove umbrella camera radio phone computer guitar piano drum song story
secret message question answer problem idea dream plan game party dinner lunch breakfast
holiday winter summer autumn spring morning evening weather storm cloud wind snow moon star
planet ocean desert jungle farm barn fence gate path ladder rope bucket shovel garage
""".split()
ADJECTIVES = """
big small little tall short long old young happy sad angry quiet loud bright dark warm cold
hot cool soft hard heavy light fast slow clean dirty empty full rich poor strong gentle brave
clever kind friendly lazy busy careful famous strange simple beautiful ugly green yellow
purple orange white black brown golden silver wooden broken tiny huge wet dry fresh sweet
bitter sharp smooth rough narrow wide deep funny lucky hungry thirsty sleepy lonely proud
nervous calm wild
""".split()
VERBS_T = """
found lost took bought sold saw watched painted cleaned opened closed carried pushed pulled
dropped kicked threw caught fixed built broke cooked washed filled emptied moved hid liked
loved wanted needed visited called followed helped finished started remembered forgot
showed brought sent gave kept held touched dragged lifted wrapped packed counted checked
borrowed picked chose ordered answered
""".split()
VERBS_I = """
laughed smiled slept waited arrived left jumped danced sang shouted whispered listened
walked ran swam climbed fell stopped started worked played rested travelled cried returned
disappeared
""".split()
ADVERBS = """
quickly slowly quietly loudly happily sadly carefully suddenly early again today yesterday
tonight outside inside together alone always often never soon finally
""".split()
PREPOSITIONS = "in on under behind near beside across along inside over into from with without around".split()
NUMBERS = "three five six seven nine ten eleven twelve twenty hundred".split()
PLURALS = """
apples books cats dogs birds chairs cups letters boxes flowers stones trees cars boats
coins shoes tickets candles stories songs horses children friends windows bottles eggs
""".split()

VOCABULARY = sorted(
    set(DETERMINERS + NAMES + NOUNS + ADJECTIVES + VERBS_T + VERBS_I + ADVERBS + PREPOSITIONS
        + NUMBERS + PLURALS + "was very and said that".split())
)


class SentenceGenerator:
    """Seeded random sentences of 3-12 words from a small grammar over :data:`VOCABULARY`."""

    def __init__(self, seed: int = 0, min_words: int = 3, max_words: int = 12):
        self.rng = random.Random(seed)
        self.min_words, self.max_words = min_words, max_words

    def _np(self) -> List[str]:
        r = self.rng
        if r.random() < 0.25:
            return [r.choice(NAMES)]
        if r.random() < 0.12:
            return [r.choice(NUMBERS)] + ([r.choice(ADJECTIVES)] if r.random() < 0.3 else []) + [
                r.choice(PLURALS)
            ]
        words = [r.choice(DETERMINERS)]
        if r.random() < 0.45:
            words.append(r.choice(ADJECTIVES))
        return words + [r.choice(NOUNS)]

    def _pp(self) -> List[str]:
        return [self.rng.choice(PREPOSITIONS)] + self._np()

    def _clause(self) -> List[str]:
        r = self.rng
        kind = r.random()
        if kind < 0.5:  # subject transitive-verb object [pp] [adverb]
            words = self._np() + [r.choice(VERBS_T)] + self._np()
            if r.random() < 0.35:
                words += self._pp()
        elif kind < 0.8:  # subject intransitive-verb [adverb] [pp]
            words = self._np() + [r.choice(VERBS_I)]
            if r.random() < 0.5:
                words += self._pp()
        else:  # subject was [very] adjective
            words = self._np() + ["was"] + (["very"] if r.random() < 0.3 else []) + [
                r.choice(ADJECTIVES)
            ]
        if r.random() < 0.3:
            words.append(r.choice(ADVERBS))
        return words

    def sentence(self) -> str:
        """One sentence, lower case, words separated by single spaces."""
        r = self.rng
        while True:
            words = self._clause()
            roll = r.random()
            if roll < 0.12:
                words = [r.choice(NAMES), "said", "that"] + words
            elif roll < 0.24:
                words = words + ["and"] + self._clause()
            if self.min_words <= len(words) <= self.max_words:
                return " ".join(words)


def _draw_unique(gen: SentenceGenerator, seen: set, size: int) -> List[str]:
    """``size`` sentences from ``gen`` not in ``seen`` (which they join)."""
    out, tries = [], 0
    while len(out) < size:
        s = gen.sentence()
        tries += 1
        if tries > 50 * size + 1000:
            raise RuntimeError("the grammar cannot produce enough distinct sentences")
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def make_sentence_sets(n_train: int, n_test: int, seed: int) -> Tuple[List[str], List[str]]:
    """Disjoint lists of unique sentences (test first, so its set does not depend on n_train)."""
    gen, seen = SentenceGenerator(seed), set()
    test = _draw_unique(gen, seen, n_test)
    return _draw_unique(gen, seen, n_train), test


def held_out_sentences(n: int, seed: int, n_train: int, n_test: int) -> List[str]:
    """``n`` further unique sentences, disjoint from both sets of
    ``make_sentence_sets(n_train, n_test, seed)`` (the long-stream test split: never heard in
    training, never in the quick-start test set)."""
    gen, seen = SentenceGenerator(seed), set()
    _draw_unique(gen, seen, n_test)
    _draw_unique(gen, seen, n_train)
    return _draw_unique(gen, seen, n)
