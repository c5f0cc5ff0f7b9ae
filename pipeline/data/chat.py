"""Documents as conversations, rendered through the tokenizer's chat template.

A chat model serves text wrapped in its template (role headers, turn ends, its BOS), so with
``data.chat_template`` the calibration, training and scoring text is wrapped the same way. A
record whose column holds a list of role/content messages is one conversation, rendered whole;
plain text is one user turn, as ``lowbit-run --chat`` sends a prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pipeline.errors import LowbitError

MESSAGES = "a list of {'role': ..., 'content': ...} messages"


@dataclass(frozen=True)
class Conversation:
    """One record's messages as canonical JSON: hashable, so it splits by hash as text does."""

    json: str

    @property
    def messages(self) -> list[dict[str, Any]]:
        return json.loads(self.json)


Document = str | Conversation


def conversation(value: list, where: str) -> Conversation | None:
    """A column value that is a list of messages as a Conversation (None when empty)."""
    for message in value:
        if not isinstance(message, dict):
            raise LowbitError(f"{where}: a conversation holds {message!r}; expected {MESSAGES}")
        if not isinstance(message.get("role"), str) or message.get("content") is None:
            raise LowbitError(
                f"{where}: a conversation's message {message!r} has no role or content; "
                f"expected {MESSAGES}"
            )
    if not value:
        return None
    return Conversation(json.dumps(list(value), sort_keys=True, ensure_ascii=False))


def user_turn(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def require_template(tokenizer, subject: str, fix: str, error=LowbitError) -> None:
    """Raise ``error`` naming ``subject`` and ``fix`` when ``tokenizer`` has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise error(
            f"{subject}: the tokenizer has no chat template (`chat_template` in "
            f"tokenizer_config.json or a chat_template.jinja beside it); {fix}"
        )


def render(tokenizer, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    """The template's text. It writes the special tokens (BOS...) itself: tokenize it with
    ``add_special_tokens=False``."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def render_documents(docs: list[Document], tokenizer, where: str) -> list[str]:
    """Each document as the template writes it: a conversation whole, text as one user turn."""
    require_template(
        tokenizer,
        f"data.chat_template=true ({where})",
        "set data.chat_template=false, or model.target.path to a model whose tokenizer has one",
    )
    out = []
    for i, doc in enumerate(docs):
        messages = doc.messages if isinstance(doc, Conversation) else user_turn(doc)
        try:
            out.append(render(tokenizer, messages, generation_prompt=False))
        except Exception as err:  # a template's raise_exception (e.g. roles must alternate)
            raise LowbitError(
                f"{where}: the chat template refuses document {i} ({type(err).__name__}: "
                f"{' '.join(str(err).split())[:200]}); fix that record, or set "
                "data.chat_template=false"
            ) from None
    return out
