"""Prompt token ids of OpenAI requests, computed the way vLLM computes them.

* ``/v1/completions``: a string prompt is encoded with ``add_special_tokens`` (request
  field, default True); a token-id prompt is used as is; for a batch (a list of prompts)
  the first prompt decides the route.
* ``/v1/chat/completions``: the messages are rendered with the model's chat template
  (``apply_chat_template(..., tokenize=False, add_generation_prompt=...)``, with the
  request's ``tools``, ``continue_final_message`` and ``chat_template_kwargs``), then
  encoded with ``add_special_tokens`` (default False), as vLLM's server does, so the token
  prefix matches the engine's. Text parts of list-valued message content are joined with
  newlines (vLLM's "string" content format). A request carrying its own ``chat_template``
  is not rendered: a template is code (its loops are the client's to choose), and vLLM runs one
  only with ``--trust-request-chat-template``; such a request is routed on load alone.

A request the router cannot tokenize is still forwarded (routed on load alone); the
backend answers its errors.

Given ``limit`` (the model's context, tokens), a prompt is tokenized only as far as needed to
know it exceeds it (:func:`encode_bounded`): a 3 MB prompt to an 8k-token model costs about
what a 100 kB one does, then :class:`PromptTooLong`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class TokenizeError(ValueError):
    """The request's prompt cannot be turned into token ids (the message says why)."""


class PromptTooLong(ValueError):
    """The prompt has more than ``limit`` tokens (``tokens``: its length, or a lower bound of it)."""

    def __init__(self, tokens: int, limit: int, exact: bool) -> None:
        super().__init__(f"the prompt has {'' if exact else 'at least '}{tokens} tokens, more than the "
                         f"model's context of {limit} tokens")
        self.tokens = tokens
        self.limit = limit


#: First guess of characters per token when tokenizing a text prefix (most text is 3-5).
_CHARS_PER_TOKEN = 4
#: Tokens at the end of a prefix's encoding that may differ from the whole text's (the cut
#: word): a prefix proves the text too long only with this many to spare.
_CUT_MARGIN = 16


def encode_bounded(encode: Any, text: str, limit: int | None) -> list[int]:
    """``encode(text)``, or :class:`PromptTooLong` as soon as a prefix of ``text`` shows it has
    more than ``limit`` tokens.

    Tokenizers are local: a prefix of the text encodes to a prefix of its tokens except for the
    last word, so ``encode(text[:n])`` with more than ``limit + 16`` tokens proves the text too
    long. The prefix starts at ``4 * (limit + 1)`` characters and doubles, so the work done
    is at most about three encodings of ``limit`` tokens' worth of text, however long ``text``.

    Args:
        encode: ``str -> list[int]`` (the tokenizer's encode with its options bound).
        text: the prompt text.
        limit: most tokens allowed (``None``: no bound: encode it all).

    Raises:
        PromptTooLong: more than ``limit`` tokens.
    """
    if limit is None:
        return list(encode(text))
    n = min(len(text), _CHARS_PER_TOKEN * (limit + 1))
    while True:
        ids = list(encode(text[:n]))
        if n >= len(text):
            if len(ids) > limit:
                raise PromptTooLong(len(ids), limit, exact=True)
            return ids
        if len(ids) > limit + _CUT_MARGIN:
            raise PromptTooLong(len(ids) - _CUT_MARGIN, limit, exact=False)
        n = min(len(text), 2 * n)


class Tokenizer(Protocol):
    """What the router needs of a Hugging Face tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer (with chat template) of a model folder or hub id, via ``AutoTokenizer``.

    Raises:
        TokenizeError: transformers missing, or the folder holds no tokenizer.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover (installed with vLLM)
        raise TokenizeError(f"needs transformers to load the tokenizer of {model}: {exc}") from None
    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as exc:  # noqa: BLE001 - any loader failure
        raise TokenizeError(f"cannot load the tokenizer of {model}: {exc}") from None


def _token_list(x: Sequence[Any], limit: int | None = None) -> list[int]:
    if limit is not None and len(x) > limit:
        raise PromptTooLong(len(x), limit, exact=True)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in x):
        raise TokenizeError("prompt: token ids must be integers in [0, 2**32)")
    return list(x)


def _message_text(content: Any) -> Any:
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif isinstance(p, str):
                parts.append(p)
            else:
                raise TokenizeError("messages: only text content parts can be routed by prefix")
        return "\n".join(parts)
    return content


class PromptTokenizer:
    """Token ids of completion and chat requests.

    Args:
        tokenizer: a Hugging Face-like tokenizer (``None``: only token-id prompts are known).
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def completion(self, body: dict[str, Any], limit: int | None = None) -> list[int]:
        """The (first) prompt of a ``/v1/completions`` body.

        Raises:
            TokenizeError: no prompt, a prompt of an unknown shape, or a text prompt without
                a tokenizer.
            PromptTooLong: more than ``limit`` tokens.
        """
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch: the first prompt decides
        if isinstance(prompt, list):
            return _token_list(prompt, limit)
        if not isinstance(prompt, str):
            raise TokenizeError("prompt: expected a string, token ids, or a list of them")
        if self.tokenizer is None:
            raise TokenizeError("text prompt and no tokenizer (start the router with --model)")
        special = bool(body.get("add_special_tokens", True))
        tok = self.tokenizer
        return encode_bounded(lambda t: tok.encode(t, add_special_tokens=special), prompt, limit)

    def chat(self, body: dict[str, Any], limit: int | None = None) -> list[int]:
        """The rendered prompt of a ``/v1/chat/completions`` body.

        Raises:
            TokenizeError: no messages, non-text content, no tokenizer, or the template fails.
            PromptTooLong: more than ``limit`` tokens.
        """
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TokenizeError("messages: expected a non-empty list")
        if self.tokenizer is None:
            raise TokenizeError("chat request and no tokenizer (start the router with --model)")
        conv = []
        for m in messages:
            if not isinstance(m, dict):
                raise TokenizeError("messages: each message must be an object")
            conv.append({**m, "content": _message_text(m.get("content"))})
        continue_final = bool(body.get("continue_final_message", False))
        if body.get("chat_template"):
            raise TokenizeError("chat_template: a request's own template is not run by the router")
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict):
            raise TokenizeError("chat_template_kwargs: expected an object")
        if "chat_template" in extra:
            raise TokenizeError("chat_template_kwargs.chat_template: a request's own template is not run by the router")
        kwargs: dict[str, Any] = dict(extra)
        kwargs.update(tokenize=False, add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                      continue_final_message=continue_final)
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        try:
            text = self.tokenizer.apply_chat_template(conv, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the template is user code
            raise TokenizeError(f"chat template failed: {exc}") from None
        if not isinstance(text, str):
            raise TokenizeError("chat template did not render text")
        special = bool(body.get("add_special_tokens", False))
        tok = self.tokenizer
        return encode_bounded(lambda t: tok.encode(t, add_special_tokens=special), text, limit)
