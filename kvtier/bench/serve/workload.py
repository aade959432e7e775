"""The serving benchmark's workloads: multi-round QA sessions and a no-reuse slice.

Multi-round QA (the shape LMCache's papers and benchmarks use): ``users`` users,
each with

- the shared system prompt (about ``system_tokens`` tokens, identical across users),
- a long private context (``context_tokens`` tokens, a window of the license texts in
  ``kvtier/demo/documents``, headed by the user's name so no two users share a prefix
  past the system prompt),
- ``rounds`` questions asked one after the other, each round's chat history holding every
  earlier question and the model's earlier answers (so a round's prompt extends the
  previous round's prompt).

Requests are issued round-major (u0r0 u1r0 ... u0r1 ...): by the time a user comes back,
the other users' contexts have gone through the engine, which is what makes the working
set exceed engine KV memory. Token counts come from a :class:`Tokenizer` (the model's
Hugging Face tokenizer in a real run, a fake one in tests).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.demo.workload import load_documents

#: The shared system prompt's opening; padded to ``system_tokens`` with document text.
SYSTEM_HEAD = (
    "You are a careful assistant that answers questions about software license texts. "
    "Answer in one short sentence, quote the text when you can, and say 'not stated' when "
    "the text does not answer the question. Reference material follows.\n\n"
)


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the workload uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of the multi-round QA workload.

    Attributes:
        users: number of users (sessions), >= 1.
        rounds: questions per user, >= 1.
        system_tokens: tokens of the shared system prompt (about; cut on a token boundary).
        context_tokens: (min, max) tokens of each user's private context, drawn uniformly.
        max_tokens: tokens generated per answer (small, so prefill dominates).
        seed: seed of the context lengths and windows.
        user_offset: first user's index (a second workload with other users: the "fits" run).
    """

    users: int = 12
    rounds: int = 3
    system_tokens: int = 300
    context_tokens: tuple[int, int] = (1500, 3000)
    max_tokens: int = 16
    seed: int = 0
    user_offset: int = 0

    def __post_init__(self) -> None:
        lo, hi = self.context_tokens
        if self.users < 1 or self.rounds < 1 or self.max_tokens < 1 or self.system_tokens < 1:
            raise ValueError("users, rounds, system_tokens and max_tokens must be >= 1")
        if not 1 <= lo <= hi:
            raise ValueError(f"context_tokens must satisfy 1 <= min <= max, got {self.context_tokens}")


@dataclass
class Session:
    """One user's conversation.

    Attributes:
        user: user index (stable name ``u<index>``).
        system: the shared system prompt (identical text for every user).
        context: this user's private context.
        questions: one question per round.
        answers: the answers received so far (filled in by the client as rounds complete).
    """

    user: int
    system: str
    context: str
    questions: list[str]
    answers: list[str] = field(default_factory=list)

    def request_id(self, rnd: int) -> str:
        """Stable id of round ``rnd`` of this user, the same in every configuration: ``u3-r1``."""
        return f"u{self.user}-r{rnd}"

    def messages(self, rnd: int, answers: Sequence[str] | None = None) -> list[dict[str, str]]:
        """The chat messages of round ``rnd`` (0-based): system, then the growing history.

        ``answers`` (default: the answers received) must hold at least ``rnd`` answers.
        """
        got = self.answers if answers is None else answers
        if len(got) < rnd:
            raise ValueError(f"round {rnd} of user {self.user} needs {rnd} earlier answers, have {len(got)}")
        msgs = [{"role": "system", "content": self.system}]
        for i in range(rnd + 1):
            content = self.questions[i] if i else f"{self.context}\n\nQuestion: {self.questions[0]}"
            msgs.append({"role": "user", "content": content})
            if i < rnd:
                msgs.append({"role": "assistant", "content": got[i]})
        return msgs


def _corpus() -> tuple[str, list[str]]:
    docs = load_documents()
    text = "\n\n".join(d.text for d in docs)
    questions = [q for d in docs for q in d.questions]
    return text, questions


def build_sessions(spec: WorkloadSpec, tokenizer: Tokenizer, corpus: tuple[str, list[str]] | None = None) -> list[Session]:
    """The sessions of ``spec``; deterministic for a given seed and tokenizer.

    ``corpus`` (text, questions) defaults to the demo's license documents.
    """
    text, questions = corpus if corpus is not None else _corpus()
    if not questions:
        raise ValueError("the corpus has no questions")
    ids = tokenizer.encode(text, add_special_tokens=False)
    system = SYSTEM_HEAD + tokenizer.decode(ids[: max(1, spec.system_tokens - len(tokenizer.encode(SYSTEM_HEAD, add_special_tokens=False)))])
    rng = random.Random(spec.seed)
    lo, hi = spec.context_tokens
    sessions = []
    for k in range(spec.users):
        user = spec.user_offset + k
        n = rng.randint(lo, hi)
        start = rng.randrange(0, max(1, len(ids) - n))
        window = ids[start : start + n]
        while len(window) < n:  # a corpus shorter than the context: wrap around
            window = window + ids[: n - len(window)]
        context = f"Notes of user {user}:\n" + tokenizer.decode(window)
        qs = [questions[(user + r * 7) % len(questions)] for r in range(spec.rounds)]
        sessions.append(Session(user=user, system=system, context=context, questions=qs))
    return sessions


def prompt_ids(tokenizer: Tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """The prompt the server sees for ``messages``: the chat template with the generation prompt."""
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


def placeholder_answers(spec: WorkloadSpec) -> list[str]:
    """Stand-in answers of ``max_tokens`` words, for sizing before the real answers exist."""
    return [" ".join(["answer"] * spec.max_tokens)] * spec.rounds


@dataclass(frozen=True)
class WorkingSet:
    """The KV footprint of a workload, in engine blocks.

    Attributes:
        block_size: engine block size (tokens).
        blocks: distinct KV blocks over the whole run (shared prefixes counted once).
        max_prompt_tokens: longest prompt.
        prompt_tokens: every request's prompt length, in request order.
        full_blocks: distinct *full* blocks: what a chunk store (kvtier, chunk = block) keeps.
            Every prompt's partial last block is distinct, so ``blocks`` overstates the
            stored footprint (by about one block per request); tier capacities are sized on
            this count.
    """

    block_size: int
    blocks: int
    max_prompt_tokens: int
    prompt_tokens: tuple[int, ...]
    full_blocks: int = 0

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def full_tokens(self) -> int:
        """Tokens in full blocks (``full_blocks * block_size``): the stored footprint."""
        return self.full_blocks * self.block_size


def working_set(prompts: Sequence[Sequence[int]], block_size: int) -> WorkingSet:
    """Distinct full and partial blocks over ``prompts`` (token id lists), prefix-aware.

    A block is identified by the whole token prefix up to its end (as an engine's prefix
    cache identifies it), so a block shared by several prompts (the system prompt, an
    earlier round) counts once. Raises ValueError on an empty list or block_size < 1.
    """
    if block_size < 1 or not prompts:
        raise ValueError("working_set needs prompts and block_size >= 1")
    seen: set[tuple[int, ...]] = set()
    full = 0
    for p in prompts:
        for end in range(block_size, len(p) + block_size, block_size):
            key = tuple(p[: min(end, len(p))])
            if key not in seen:
                seen.add(key)
                full += end <= len(p)
    return WorkingSet(block_size, len(seen), max(len(p) for p in prompts), tuple(len(p) for p in prompts), full)


def workload_prompts(sessions: Sequence[Session], tokenizer: Tokenizer, answers: Sequence[str] | None = None) -> list[list[int]]:
    """Every request's prompt ids in issue order (round-major), with ``answers`` as history.

    ``answers`` default: each session's received answers (a finished run).
    """
    rounds = len(sessions[0].questions) if sessions else 0
    return [
        prompt_ids(tokenizer, s.messages(r, answers if answers is not None else s.answers))
        for r in range(rounds)
        for s in sessions
    ]


def engine_blocks_for_ratio(ws: WorkingSet, ratio: float, concurrency: int, max_model_len: int, max_tokens: int) -> int:
    """Engine KV blocks so that ``ws.blocks >= ratio * blocks``; at least what ``concurrency``
    requests of the longest prompt and one ``max_model_len`` request need.

    Raises ValueError when both cannot hold (more users, fewer concurrent requests or a
    smaller ratio are needed); the message gives the numbers.
    """
    per_req = math.ceil((ws.max_prompt_tokens + max_tokens) / ws.block_size)
    floor_blocks = max(concurrency * per_req + 1, math.ceil(max_model_len / ws.block_size))
    blocks = int(ws.blocks // ratio)
    if blocks < floor_blocks:
        raise ValueError(
            f"working set of {ws.blocks} blocks cannot be {ratio}x engine KV: the engine needs at least "
            f"{floor_blocks} blocks ({concurrency} concurrent requests of {per_req} blocks, max_model_len "
            f"{max_model_len}); add users or lower the concurrency"
        )
    return blocks


def no_reuse_prompts(n: int, tokenizer: Tokenizer, tokens: int, seed: int = 1, corpus: str | None = None) -> list[str]:
    """``n`` prompts of about ``tokens`` tokens that share no prefix (each starts with its own id)."""
    text = corpus if corpus is not None else _corpus()[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        start = rng.randrange(0, max(1, len(ids) - tokens))
        out.append(f"Request {i} ({rng.getrandbits(48):012x}): " + tokenizer.decode(ids[start : start + tokens]))
    return out


def prompt_hash_ids(prompts: Sequence[Sequence[int]], block_size: int) -> list[list[int]]:
    """Mooncake-format ``hash_ids`` of each prompt (one per ``block_size``-token block, the
    last possibly partial): a block's id is the order of first sight of its whole token
    prefix, so two prompts share their first ``k`` ids exactly when they share their first
    ``k * block_size`` tokens (as an engine's prefix cache sees them). Raises ValueError for
    block_size < 1."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for p in prompts:
        ids = []
        for end in range(block_size, len(p) + block_size, block_size):
            key = tuple(p[: min(end, len(p))])
            ids.append(seen.setdefault(key, len(seen)))
        out.append(ids)
    return out
