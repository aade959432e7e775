"""Synthetic, seeded request traces for the eviction simulator.

Two workload shapes whose reuse comes from shared prompt prefixes:

- ``multi-turn``: chat sessions. Each session starts from one of a few system
  prompts (shared across sessions) and grows turn by turn: the prompt of turn
  ``k`` is the system prompt, every earlier user message and assistant reply,
  and the new user message. A pool of concurrently active sessions is
  interleaved; a finished session is replaced by a new one.
- ``long-doc``: long-document question answering. Each prompt is a shared
  instruction header, one document and one question about it; documents are
  chosen with Zipf popularity and questions about a document also with Zipf
  popularity, so popular (document, question) pairs come back.
- ``mixed``: both streams interleaved request by request.

Token ids are drawn uniformly from the vocabulary, so distinct texts never
share a chunk by accident; lengths follow log-normal distributions (tokens).
Every draw comes from one ``numpy.random.Generator`` seeded by ``seed``: the
same arguments give the same trace on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

TRACES = ("multi-turn", "long-doc", "mixed")


@dataclass(frozen=True)
class Request:
    """One prompt of a trace.

    Attributes:
        tokens: prompt token ids, uint32 ``[num_tokens]``.
        kind: ``"multi-turn"`` or ``"long-doc"``.
        source: session or document id within its kind.
    """

    tokens: np.ndarray
    kind: str
    source: int


@dataclass(frozen=True)
class TraceParams:
    """Shape of a synthetic trace. Lengths are in tokens.

    Attributes:
        num_requests: prompts in the trace.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        system_prompt_tokens: lengths of the shared chat system prompts.
        active_sessions: chat sessions interleaved at any time.
        mean_turns: mean turns per chat session (geometric, at least 1).
        user_tokens / reply_tokens: median lengths of user messages and assistant replies.
        header_tokens: shared instruction header of document prompts.
        num_documents: documents in the long-document corpus.
        doc_tokens: median document length.
        questions_per_doc: distinct questions per document.
        question_tokens: median question length.
        doc_zipf / question_zipf: Zipf exponents of document and question popularity.
    """

    num_requests: int = 2000
    vocab_size: int = 49152
    system_prompt_tokens: tuple[int, ...] = (700, 1500, 2600)
    active_sessions: int = 24
    mean_turns: float = 6.0
    user_tokens: int = 80
    reply_tokens: int = 300
    header_tokens: int = 120
    num_documents: int = 80
    doc_tokens: int = 6000
    questions_per_doc: int = 12
    question_tokens: int = 40
    doc_zipf: float = 1.1
    question_zipf: float = 1.0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")


def _lognormal_len(rng: np.random.Generator, median: int, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))


def _zipf_probs(n: int, exponent: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** exponent
    return w / w.sum()


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=n, dtype=np.uint32)


def _multi_turn(rng: np.random.Generator, p: TraceParams) -> Iterator[Request]:
    systems = [_tokens(rng, n, p.vocab_size) for n in p.system_prompt_tokens]
    sys_probs = _zipf_probs(len(systems), 1.0)
    next_id = 0

    def new_session() -> dict:
        nonlocal next_id
        next_id += 1
        return {
            "id": next_id - 1,
            "history": [systems[rng.choice(len(systems), p=sys_probs)]],
            "turns_left": int(rng.geometric(1.0 / p.mean_turns)),
        }

    active = [new_session() for _ in range(p.active_sessions)]
    while True:
        i = int(rng.integers(len(active)))
        s = active[i]
        user = _tokens(rng, _lognormal_len(rng, p.user_tokens, 0.8, 8, 2000), p.vocab_size)
        s["history"].append(user)
        yield Request(np.concatenate(s["history"]), "multi-turn", s["id"])
        reply = _tokens(rng, _lognormal_len(rng, p.reply_tokens, 0.7, 16, 2000), p.vocab_size)
        s["history"].append(reply)
        s["turns_left"] -= 1
        if s["turns_left"] <= 0:
            active[i] = new_session()


def _long_doc(rng: np.random.Generator, p: TraceParams) -> Iterator[Request]:
    header = _tokens(rng, p.header_tokens, p.vocab_size)
    docs = [
        _tokens(rng, _lognormal_len(rng, p.doc_tokens, 0.6, 1000, 32000), p.vocab_size)
        for _ in range(p.num_documents)
    ]
    questions = [
        [
            _tokens(rng, _lognormal_len(rng, p.question_tokens, 0.5, 8, 400), p.vocab_size)
            for _ in range(p.questions_per_doc)
        ]
        for _ in range(p.num_documents)
    ]
    doc_probs = _zipf_probs(p.num_documents, p.doc_zipf)
    q_probs = _zipf_probs(p.questions_per_doc, p.question_zipf)
    doc_rank = rng.permutation(p.num_documents)  # popularity rank -> document
    while True:
        d = int(doc_rank[rng.choice(p.num_documents, p=doc_probs)])
        q = int(rng.choice(p.questions_per_doc, p=q_probs))
        yield Request(np.concatenate([header, docs[d], questions[d][q]]), "long-doc", d)


def generate(trace: str, seed: int = 0, params: TraceParams | None = None) -> list[Request]:
    """Build a trace.

    Args:
        trace: one of :data:`TRACES`.
        seed: RNG seed; equal arguments give equal traces.
        params: trace shape (default :class:`TraceParams`).

    Returns:
        ``params.num_requests`` requests in arrival order.

    Raises:
        ValueError: unknown trace name.
    """
    if trace not in TRACES:
        raise ValueError(f"unknown trace {trace!r}; choose one of {', '.join(TRACES)}")
    p = params or TraceParams()
    rng = np.random.default_rng(seed)
    if trace == "multi-turn":
        stream = _multi_turn(rng, p)
        return [next(stream) for _ in range(p.num_requests)]
    if trace == "long-doc":
        stream = _long_doc(rng, p)
        return [next(stream) for _ in range(p.num_requests)]
    chat, docs = _multi_turn(rng, p), _long_doc(rng, p)
    return [next(chat) if rng.random() < 0.5 else next(docs) for _ in range(p.num_requests)]
