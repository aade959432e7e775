"""The demo's long-document QA workload: documents, questions, prompts, visit order.

Documents are full license texts shipped in ``kvtier/demo/documents``; the
questions live in ``documents/questions.json``. A prompt is the model's chat
template applied to one user message holding the document first and the question
after it, so every question about one document shares the document's token
prefix (the part kvtier can reuse). Documents are visited interleaved
(d1q1 d2q1 ... dNq1 d1q2 ...), so by the time a document comes back the others
have pushed it out of vLLM's deliberately small KV space.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

DOCUMENTS_DIR = Path(__file__).parent / "documents"
QUESTIONS_FILE = DOCUMENTS_DIR / "questions.json"

# The token budget each prompt must fit: long enough that prefill dominates
# TTFT, short enough for max_model_len 8192 and a CPU-only run in minutes.
MIN_PROMPT_TOKENS = 2000
MAX_PROMPT_TOKENS = 7000

QUICK_DOCUMENTS = 2
QUICK_QUESTIONS = 2


class WorkloadError(ValueError):
    """The question file or a document is missing or malformed."""


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer the workload uses."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Document:
    """One document and its questions.

    Attributes:
        doc_id: short stable name (e.g. ``"gpl-2"``).
        title: human-readable title.
        text: the full document text (UTF-8).
        questions: questions answerable from ``text``.
        references: the answer found in the text, one per question (for readers).
    """

    doc_id: str
    title: str
    text: str
    questions: tuple[str, ...]
    references: tuple[str, ...]


@dataclass(frozen=True)
class Visit:
    """One request of the workload, in visit order.

    Attributes:
        doc_id: which document.
        question_index: 0-based index of the question within its document.
        question: the question text.
        prompt_token_ids: the full prompt as token ids (chat template applied).
        first_visit: True on the first request about this document.
    """

    doc_id: str
    question_index: int
    question: str
    prompt_token_ids: tuple[int, ...]
    first_visit: bool

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)


def load_documents(questions_file: Path = QUESTIONS_FILE) -> list[Document]:
    """Read the question file and the documents it names, in file order.

    Raises:
        WorkloadError: unreadable/invalid JSON, a missing document, a document
            without questions, or a duplicate id.
    """
    try:
        data = json.loads(questions_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"cannot read question file {questions_file}: {exc}") from None
    entries = data.get("documents") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise WorkloadError(f"{questions_file}: expected a non-empty 'documents' list")
    docs: list[Document] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        try:
            doc_id, title, fname = str(entry["id"]), str(entry["title"]), str(entry["file"])
            qs = [(str(q["question"]), str(q.get("reference", ""))) for q in entry["questions"]]
        except (KeyError, TypeError) as exc:
            raise WorkloadError(f"{questions_file}: document #{i} is malformed ({exc!r})") from None
        if doc_id in seen:
            raise WorkloadError(f"{questions_file}: duplicate document id {doc_id!r}")
        if not qs or any(not q.strip() for q, _ in qs):
            raise WorkloadError(f"{questions_file}: document {doc_id!r} needs non-empty questions")
        path = questions_file.parent / fname
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise WorkloadError(f"document {doc_id!r}: cannot read {path}: {exc}") from None
        seen.add(doc_id)
        docs.append(Document(doc_id, title, text, tuple(q for q, _ in qs), tuple(r for _, r in qs)))
    return docs


def user_message(document: Document, question: str) -> str:
    """The user turn: the document first, then the question (document-first keeps the shared prefix)."""
    return (
        f"{document.text.rstrip()}\n\n"
        f"Answer this question about the document above in one short sentence.\n"
        f"Question: {question}"
    )


def prompt_token_ids(tokenizer: ChatTokenizer, document: Document, question: str) -> list[int]:
    """Token ids of the chat-templated prompt (system turn from the template, then the user turn)."""
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message(document, question)}],
        add_generation_prompt=True,
        tokenize=True,
    )
    if isinstance(out, dict) or hasattr(out, "keys"):  # BatchEncoding in newer transformers
        out = out["input_ids"]
    return [int(t) for t in out]


def select(documents: Sequence[Document], quick: bool) -> list[Document]:
    """The documents (and questions) a run uses: all, or the first 2 x 2 when ``quick``."""
    if not quick:
        return list(documents)
    return [
        Document(d.doc_id, d.title, d.text, d.questions[:QUICK_QUESTIONS], d.references[:QUICK_QUESTIONS])
        for d in documents[:QUICK_DOCUMENTS]
    ]


def interleave(documents: Sequence[Document], tokenizer: ChatTokenizer) -> list[Visit]:
    """All (document, question) requests in interleaved order: d1q1 d2q1 ... d1q2 d2q2 ...

    Raises:
        WorkloadError: a prompt falls outside ``MIN_PROMPT_TOKENS..MAX_PROMPT_TOKENS``.
    """
    visits: list[Visit] = []
    rounds = max((len(d.questions) for d in documents), default=0)
    for qi in range(rounds):
        for doc in documents:
            if qi >= len(doc.questions):
                continue
            ids = prompt_token_ids(tokenizer, doc, doc.questions[qi])
            if not MIN_PROMPT_TOKENS <= len(ids) <= MAX_PROMPT_TOKENS:
                raise WorkloadError(
                    f"document {doc.doc_id!r} question {qi}: prompt is {len(ids)} tokens, "
                    f"outside {MIN_PROMPT_TOKENS}..{MAX_PROMPT_TOKENS}"
                )
            visits.append(Visit(doc.doc_id, qi, doc.questions[qi], tuple(ids), first_visit=qi == 0))
    return visits


def kv_blocks_needed(visits: Sequence[Visit], max_tokens: int, block_size: int, margin_blocks: int) -> int:
    """Engine KV blocks for the longest prompt plus its answer plus a margin.

    This is the demo's deliberately small KV space: one document fits, all of
    them do not, so vLLM's own prefix cache cannot carry the reuse.
    """
    longest = max(v.prompt_tokens for v in visits) + max_tokens
    return -(-longest // block_size) + margin_blocks
