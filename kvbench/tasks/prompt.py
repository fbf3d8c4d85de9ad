"""Token-exact prompt assembly shared by every task.

A retrieval prompt is built from separately tokenized pieces so that the prefix length is exact and
token positions (needle depth) are known without re-tokenizing the whole string:

    prefix = head + document [+ question]        (compressed by the strategy)
    query  = [question +] tail + answer_prefix   (processed after compression)

``head`` holds the chat template's opening (system turn, user header) and the instruction; ``tail``
closes the user turn and opens the assistant turn. With a tokenizer that has no chat template (the
byte tokenizer of ``tiny-llama``) a plain ``Document: ... Question: ... Answer:`` layout is used.

The optional answer prefix (RULER-style, e.g. "The notice period for the Orchard account is") starts
the assistant's reply. It belongs to the query, never to the compressed prefix, and turns the task
into a clean test of whether the needle survived compression rather than of instruction following.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvbench.errors import KVBenchError

_SENTINEL = "\u2063KVBENCH_CONTENT\u2063"
DEFAULT_INSTRUCTION = "Read the document below and answer the question that follows it."


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (pieces are concatenated, not re-tokenized)."""
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False))


def leading_special_ids(tokenizer: Any) -> list[int]:
    """What the tokenizer puts before any text (a BOS token for Llama-2-style tokenizers, else nothing)."""
    empty = list(tokenizer.encode("", add_special_tokens=True))
    eos = getattr(tokenizer, "eos_token_id", None)
    # A tokenizer that appends EOS (T5-style) must not end a prefix with it.
    return [i for i in empty if i != eos]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def chat_frame(tokenizer: Any) -> tuple[str, str]:
    """The chat template's text before and after a single user message (with the generation prompt)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                             add_generation_prompt=True)
    if not isinstance(rendered, str) or rendered.count(_SENTINEL) != 1:
        raise KVBenchError("the tokenizer's chat template does not render a single user message as text")
    before, after = rendered.split(_SENTINEL)
    return before, after


@dataclass(frozen=True)
class PromptPieces:
    """Tokenized pieces of one prompt; ``template`` is "chat" or "plain"."""

    template: str
    head: list[int]
    question: list[int]
    tail: list[int]
    answer_prefix: list[int]
    answer_sep: str  # what separates the reply's start from the answer: " " after a prefix or "Answer:"

    def document_budget(self, context_tokens: int, query_aware: bool) -> int:
        """Document tokens that make ``len(prefix) == context_tokens``."""
        return context_tokens - len(self.head) - (len(self.question) if query_aware else 0)

    def gold_ids(self, tokenizer: Any, answer: str) -> list[int]:
        """Reference reply tokens, as they follow ``query_ids`` (teacher-forced for NLL/KL)."""
        return encode(tokenizer, self.answer_sep + answer)

    def assemble(self, document: list[int], query_aware: bool) -> tuple[list[int], list[int]]:
        """Return (prefix_ids, query_ids)."""
        if query_aware:
            return self.head + document + self.question, self.tail + self.answer_prefix
        return self.head + document, self.question + self.tail + self.answer_prefix


def build_pieces(tokenizer: Any, question: str, answer_prefix: str = "",
                 instruction: str = DEFAULT_INSTRUCTION, document_label: str = "Document") -> PromptPieces:
    """Tokenize the fixed parts of a question-over-a-document prompt for ``tokenizer``."""
    intro = f"{instruction}\n\n{document_label}:\n" if instruction else f"{document_label}:\n"
    qtext = f"\n\nQuestion: {question}"
    if has_chat_template(tokenizer):
        before, after = chat_frame(tokenizer)
        return PromptPieces(
            template="chat",
            head=encode(tokenizer, before) + encode(tokenizer, intro),
            question=encode(tokenizer, qtext),
            tail=encode(tokenizer, after),
            answer_prefix=encode(tokenizer, answer_prefix),
            answer_sep=" " if answer_prefix else "",
        )
    return PromptPieces(
        template="plain",
        head=leading_special_ids(tokenizer) + encode(tokenizer, intro),
        question=encode(tokenizer, qtext),
        tail=encode(tokenizer, "\nAnswer:"),
        # After "Answer:" the reply needs its separating space; the chat template ends in a newline.
        answer_prefix=encode(tokenizer, f" {answer_prefix}") if answer_prefix else [],
        answer_sep=" ",
    )


def truncate_middle(ids: list[int], budget: int) -> list[int]:
    """Keep the first and last ``budget / 2`` tokens (LongBench convention for over-long contexts)."""
    if budget <= 0:
        return []
    if len(ids) <= budget:
        return list(ids)
    head = budget // 2
    return list(ids[:head]) + list(ids[len(ids) - (budget - head):])
