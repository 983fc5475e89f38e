"""The three request streams of the demo, drawn from fixed seeds.

Token ids are random: a random-init model has no tokenizer worth the name, and prefix caching
only cares whether ids repeat, never what they mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Request", "Workload", "WorkloadShape", "make_workloads", "WORKLOAD_NAMES"]

WORKLOAD_NAMES = ("rag", "multi_turn", "system_prompt")


@dataclass(frozen=True)
class Request:
    """One prompt, sent after every request before it in its workload."""

    tokens: torch.Tensor  # 1-D int64
    label: str
    #: Requests with the same group are summarised together (RAG: how many documents).
    group: str = ""


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    #: Prompts whose KV is computed and put before the timed requests (RAG: the documents).
    ingest: tuple[torch.Tensor, ...]
    requests: tuple[Request, ...]
    #: What a hit can reuse in this workload, in one sentence for the report.
    reuse: str = ""
    groups: tuple[str, ...] = field(default=())
    #: What one request is, for axis labels.
    unit: str = "request"


@dataclass(frozen=True)
class WorkloadShape:
    """Token counts and request counts; ``scaled`` shrinks the token counts for quick runs."""

    rag_documents: int = 8
    rag_document_tokens: int = 2048
    rag_questions: int = 24
    rag_max_documents_per_question: int = 3
    rag_question_tokens: tuple[int, int] = (24, 64)
    #: Questions asked over one retrieval result (the first one and its follow-ups).
    rag_questions_per_retrieval: int = 3
    turns: int = 10
    turn_tokens: tuple[int, int] = (200, 400)
    #: The agent's system prompt and tool definitions, before the first turn.
    agent_preamble_tokens: int = 1024
    system_prompt_tokens: int = 4096
    users: int = 20
    user_question_tokens: tuple[int, int] = (16, 64)

    def scaled(self, factor: float) -> WorkloadShape:
        def tokens(n: int) -> int:
            return max(1, round(n * factor))

        def span(lo_hi: tuple[int, int]) -> tuple[int, int]:
            return tokens(lo_hi[0]), max(tokens(lo_hi[0]), tokens(lo_hi[1]))

        return WorkloadShape(
            rag_documents=self.rag_documents,
            rag_document_tokens=tokens(self.rag_document_tokens),
            rag_questions=self.rag_questions,
            rag_max_documents_per_question=self.rag_max_documents_per_question,
            rag_question_tokens=span(self.rag_question_tokens),
            rag_questions_per_retrieval=self.rag_questions_per_retrieval,
            turns=self.turns,
            turn_tokens=span(self.turn_tokens),
            agent_preamble_tokens=tokens(self.agent_preamble_tokens),
            system_prompt_tokens=tokens(self.system_prompt_tokens),
            users=self.users,
            user_question_tokens=span(self.user_question_tokens),
        )


def _ids(gen: torch.Generator, n: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int64)


def _length(gen: torch.Generator, lo_hi: tuple[int, int]) -> int:
    lo, hi = lo_hi
    return int(torch.randint(lo, hi + 1, (1,), generator=gen).item())


def rag(shape: WorkloadShape, *, vocab: int, seed: int) -> Workload:
    """Documents ingested once, then questions over 1 to N of them.

    Questions come in threads, as in a RAG chat: one retrieval picks the documents, and
    ``rag_questions_per_retrieval`` questions (the first and its follow-ups) are asked over
    them. Retrieval draws the number of documents uniformly and the documents uniformly without
    replacement, then sorts them by id (the canonical order) so that the same set always forms
    the same prefix. Keys chain the whole prefix, so the first question over [A][B] reuses the
    ingested KV of A (A is first, at the same positions) and computes B; its follow-ups reuse
    [A][B] whole. B's ingested KV is worthless after A (other positions, other attention
    context). With ``rag_questions_per_retrieval=1`` every question is a new retrieval.
    """
    gen = torch.Generator().manual_seed(seed)
    docs = [_ids(gen, shape.rag_document_tokens, vocab) for _ in range(shape.rag_documents)]
    requests = []
    per = max(1, shape.rag_questions_per_retrieval)
    chosen: list[int] = []
    k = 0
    for q in range(shape.rag_questions):
        if q % per == 0:
            k = int(torch.randint(1, shape.rag_max_documents_per_question + 1, (1,),
                                  generator=gen).item())
            chosen = sorted(torch.randperm(shape.rag_documents, generator=gen)[:k].tolist())
        question = _ids(gen, _length(gen, shape.rag_question_tokens), vocab)
        tokens = torch.cat([*(docs[d] for d in chosen), question])
        group = f"{k} doc" + ("s" if k > 1 else "")
        kind = "first" if q % per == 0 else "follow-up"
        requests.append(Request(tokens, f"q{q + 1} docs={chosen} ({kind})", group))
    groups = tuple(f"{k} doc" + ("s" if k > 1 else "")
                   for k in range(1, shape.rag_max_documents_per_question + 1))
    return Workload(
        "rag",
        f"RAG: {shape.rag_documents} documents x {shape.rag_document_tokens} tokens, "
        f"{shape.rag_questions} questions over 1-{shape.rag_max_documents_per_question} of "
        f"them, {per} per retrieval",
        tuple(docs), tuple(requests),
        reuse="the first document's ingested KV on a retrieval's first question; the whole "
              "document set on its follow-ups",
        groups=groups,
        unit="question",
    )


def multi_turn(shape: WorkloadShape, *, vocab: int, seed: int) -> Workload:
    """One agent conversation: a system prompt with tool definitions, then turns, each turn's
    prompt the previous prompt plus new tokens (tool output and the model's reply)."""
    gen = torch.Generator().manual_seed(seed)
    history = _ids(gen, shape.agent_preamble_tokens, vocab)
    requests = []
    for turn in range(shape.turns):
        history = torch.cat([history, _ids(gen, _length(gen, shape.turn_tokens), vocab)])
        requests.append(Request(history, f"turn {turn + 1}"))
    return Workload(
        "multi_turn",
        f"Multi-turn: an agent with a {shape.agent_preamble_tokens}-token system prompt and "
        f"tools, then {shape.turns} turns, each adding "
        f"{shape.turn_tokens[0]}-{shape.turn_tokens[1]} tokens",
        (), tuple(requests),
        reuse="the whole previous turn, including its partial last chunk",
        unit="turn",
    )


def system_prompt(shape: WorkloadShape, *, vocab: int, seed: int) -> Workload:
    """Many users behind one long system prompt, each with a short question of their own."""
    gen = torch.Generator().manual_seed(seed)
    system = _ids(gen, shape.system_prompt_tokens, vocab)
    requests = [
        Request(torch.cat([system, _ids(gen, _length(gen, shape.user_question_tokens), vocab)]),
                f"user {u + 1}")
        for u in range(shape.users)
    ]
    return Workload(
        "system_prompt",
        f"Shared system prompt: {shape.system_prompt_tokens} tokens, {shape.users} users",
        (), tuple(requests),
        reuse="the system prompt (the first user computes it)",
        unit="user",
    )


def make_workloads(shape: WorkloadShape, *, vocab: int, seed: int,
                   names: tuple[str, ...] = WORKLOAD_NAMES) -> list[Workload]:
    """The workloads named, in the order of WORKLOAD_NAMES; each draws from its own seed, which
    does not depend on which others were chosen."""
    makers = {"rag": rag, "multi_turn": multi_turn, "system_prompt": system_prompt}
    return [makers[name](shape, vocab=vocab, seed=seed + i) for i, name in
            enumerate(WORKLOAD_NAMES) if name in names]
