"""One OpenAI request body, as the router needs it: parsed, its prompt tokenized within the context.

Runs on one of the router's worker threads (:mod:`.admission`), never on its event loop:
decoding a body of several megabytes, checking a long token-id list or tokenizing a long
prompt takes milliseconds to seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvtier.router.tokenize import PromptTokenizer, PromptTooLong

_DECODER = msgspec.json.Decoder()


class BadBody(ValueError):
    """The body is not a JSON object (the message says why)."""


@dataclass(frozen=True)
class Prepared:
    """What routing needs of a request.

    Attributes:
        tokens: the prompt's token ids (``None``: not known; the request is routed on load).
        salt: its ``cache_salt`` (``None``: none).
        why_untokenized: why ``tokens`` is ``None`` (for the debug log).
    """

    tokens: list[int] | None
    salt: str | None
    why_untokenized: str | None = None


def prepare(body: bytes, chat: bool, tokenizer: PromptTokenizer, limit: int | None) -> Prepared:
    """Parse ``body`` and tokenize its prompt (``chat``: a chat completion).

    Args:
        body: the raw request body (bounded by the caller).
        chat: ``/v1/chat/completions`` (else ``/v1/completions``).
        tokenizer: the router's prompt tokenizer.
        limit: the model's context in tokens (``None``: unknown, not checked).

    Raises:
        BadBody: not JSON, or not an object.
        PromptTooLong: the prompt has more than ``limit`` tokens.
    """
    try:
        payload: Any = _DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise BadBody(f"body is not JSON ({str(exc)[:200]})") from None
    if not isinstance(payload, dict):
        raise BadBody(f"body is not a JSON object (got {type(payload).__name__})")
    salt = payload.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    try:
        tokens = tokenizer.chat(payload, limit) if chat else tokenizer.completion(payload, limit)
    except PromptTooLong:
        raise
    except Exception as exc:  # noqa: BLE001 - a field of the wrong type, a tokenizer that chokes on the
        # input: the request is routed on load and the backend answers it (never a router 500)
        return Prepared(None, salt, f"{type(exc).__name__}: {exc}"[:300])
    return Prepared(tokens, salt)
