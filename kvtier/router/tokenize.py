"""Prompt token ids of OpenAI requests, computed the way vLLM computes them.

* ``/v1/completions``: a string prompt is encoded with ``add_special_tokens`` (request
  field, default True); a token-id prompt is used as is; for a batch (a list of prompts)
  the first prompt decides the route.
* ``/v1/chat/completions``: the messages are rendered with the model's chat template
  (``apply_chat_template(..., tokenize=False, add_generation_prompt=...)``, with the
  request's ``tools``, ``continue_final_message`` and ``chat_template_kwargs``), then
  encoded with ``add_special_tokens`` (default False), as vLLM's server does, so the token
  prefix matches the engine's. Text parts of list-valued message content are joined with
  newlines (vLLM's "string" content format).

A request the router cannot tokenize is still forwarded (routed on load alone); the
backend answers its errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class TokenizeError(ValueError):
    """The request's prompt cannot be turned into token ids (the message says why)."""


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


def _token_list(x: Sequence[Any]) -> list[int]:
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

    def completion(self, body: dict[str, Any]) -> list[int]:
        """The (first) prompt of a ``/v1/completions`` body.

        Raises:
            TokenizeError: no prompt, a prompt of an unknown shape, or a text prompt without
                a tokenizer.
        """
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch: the first prompt decides
        if isinstance(prompt, list):
            return _token_list(prompt)
        if not isinstance(prompt, str):
            raise TokenizeError("prompt: expected a string, token ids, or a list of them")
        if self.tokenizer is None:
            raise TokenizeError("text prompt and no tokenizer (start the router with --model)")
        return list(self.tokenizer.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True))))

    def chat(self, body: dict[str, Any]) -> list[int]:
        """The rendered prompt of a ``/v1/chat/completions`` body.

        Raises:
            TokenizeError: no messages, non-text content, no tokenizer, or the template fails.
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
        kwargs: dict[str, Any] = dict(body.get("chat_template_kwargs") or {})
        kwargs.update(tokenize=False, add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                      continue_final_message=continue_final)
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        if body.get("chat_template"):
            kwargs["chat_template"] = body["chat_template"]
        try:
            text = self.tokenizer.apply_chat_template(conv, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the template is user code
            raise TokenizeError(f"chat template failed: {exc}") from None
        if not isinstance(text, str):
            raise TokenizeError("chat template did not render text")
        return list(self.tokenizer.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False))))
