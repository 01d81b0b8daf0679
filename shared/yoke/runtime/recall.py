"""Lexical recall: the terms a memory is found by, and how candidates are ranked.

Recall must work on any MongoDB-wire server, so it needs no text index: each memory keeps its
terms (normalised words), the store finds the memories of one scope sharing a term with the
query (a bounded candidate set), and the processor ranks them here, BM25-like over that set,
newest first among equals. With an embedding model, cosine similarity is blended in.

Terms are data, never query syntax: the store compares them by equality only (``$in`` of
plain strings), so a query full of ``%``, ``.*`` or ``$where`` finds what those words find.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

# A memory keeps at most this many terms, a query uses at most this many.
MAX_TERMS = 32
MAX_QUERY_TERMS = 16
MAX_TERM_CHARS = 40
# The weight of similarity against the lexical score when both are known.
SIMILARITY_WEIGHT = 0.6

_WORD = re.compile(r"\w+", re.UNICODE)
_STOPWORD_TEXT = """a about after again all am an and any are as at be because been before being
    but by can
    could did do does doing don for from had has have having he her here hers him his how i if
    in into is it its just me more most my no nor not now of off on once only or other our ours
    out over own same she should so some such than that the their theirs them then there these
    they this those through to too under until up very was we were what when where which while
    who whom why will with would you your yours"""
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())


def terms(text: str, limit: int = MAX_TERMS) -> list[str]:
    """The distinct terms of ``text``, in order: NFKC-normalised, case-folded words of two or
    more characters that are not stopwords, a plural ``s`` dropped."""
    found: dict[str, None] = {}
    for word in _WORD.findall(unicodedata.normalize("NFKC", text).casefold()):
        word = word.strip("_")[:MAX_TERM_CHARS]
        if len(word) < 2 or word in _STOPWORDS:
            continue
        if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        found.setdefault(word, None)
        if len(found) >= limit:
            break
    return list(found)


@dataclass(frozen=True)
class Candidate:
    """A memory as ranking sees it."""

    id: str
    terms: Sequence[str]
    created_at: datetime
    vector: Sequence[float] | None = None


def rank(
    query_terms: Sequence[str],
    candidates: Sequence[Candidate],
    query_vector: Sequence[float] | None = None,
) -> list[tuple[Candidate, float]]:
    """``candidates`` best first, each with its score; those that share nothing with the query
    (no term, no similarity above zero) are left out."""
    if not candidates:
        return []
    wanted = set(query_terms)
    total = len(candidates)
    frequency: dict[str, int] = {}
    for candidate in candidates:
        for term in set(candidate.terms) & wanted:
            frequency[term] = frequency.get(term, 0) + 1
    average = sum(len(c.terms) for c in candidates) / total or 1.0
    scored: list[tuple[Candidate, float]] = []
    best_lexical = 0.0
    lexical: dict[str, float] = {}
    for candidate in candidates:
        shared = set(candidate.terms) & wanted
        idf = sum(math.log(1 + (total - frequency[t] + 0.5) / (frequency[t] + 0.5)) for t in shared)
        score = idf / (0.25 + 0.75 * len(candidate.terms) / average) if shared else 0.0
        lexical[candidate.id] = score
        best_lexical = max(best_lexical, score)
    for candidate in candidates:
        score = lexical[candidate.id] / best_lexical if best_lexical else 0.0
        if query_vector is not None and candidate.vector is not None:
            similarity = max(0.0, cosine(query_vector, candidate.vector))
            score = SIMILARITY_WEIGHT * similarity + (1 - SIMILARITY_WEIGHT) * score
        if score > 0:
            scored.append((candidate, score))
    scored.sort(key=lambda pair: (-pair[1], -pair[0].created_at.timestamp(), pair[0].id))
    return scored


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity; 0 for vectors of different lengths or of no length."""
    if len(a) != len(b) or not a:
        return 0.0
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
