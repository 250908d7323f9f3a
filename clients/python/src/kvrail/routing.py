"""Which prefill and which decode engine a request goes to: the router's
policies, without I/O (the router calls :meth:`Pools.pick` and
:meth:`Pools.release` around each upstream call).

- ``round_robin``: engines of a role in turn.
- ``least_loaded``: the engine with the fewest queued tokens, counted by this
  router: a request's tokens are queued on its engine from the pick until its
  call returns (prompt tokens on the prefill engine; prompt and generated
  tokens on the decode engine). Ties go round robin.

Engines come and go (:meth:`Pools.set_engines`): one that leaves is never
picked again; what it had queued is forgotten when its calls return.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

POLICIES = ("round_robin", "least_loaded")
ROLES = ("prefill", "decode")


class NoEngine(Exception):
    """No engine of the role is known right now."""


@dataclass(frozen=True)
class Engine:
    """An upstream engine: its HTTP API, and for push mode its kvrail node and
    connector worker id (whom a decode engine grants its blocks to)."""

    url: str
    push_to: tuple[str, str] | None = None
    name: str = ""


def estimate_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a completion or chat request, without a tokenizer:
    exact for token-id prompts, else about 4 bytes of text per token."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    text = 0
    if isinstance(prompt, str):
        text = len(prompt.encode())
    elif isinstance(prompt, list):
        text = sum(len(p.encode()) for p in prompt if isinstance(p, str))
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                text += len(content.encode())
    return text // 4 + 1


def output_tokens(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return 16  # vLLM's default max_tokens for completions


class Pools:
    """The engines of each role and what this router has queued on each."""

    def __init__(self, policy: str = "round_robin") -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is none of {POLICIES}")
        self.policy = policy
        self._lock = threading.Lock()
        self._engines: dict[str, list[Engine]] = {r: [] for r in ROLES}
        self._turn: dict[str, int] = {r: 0 for r in ROLES}
        self._queued: dict[tuple[str, str], int] = {}

    def set_engines(self, role: str, engines: list[Engine]) -> None:
        with self._lock:
            self._engines[role] = sorted(engines, key=lambda e: (e.name, e.url))

    def engines(self, role: str) -> list[Engine]:
        with self._lock:
            return list(self._engines[role])

    def queued(self, role: str) -> dict[str, int]:
        """Tokens queued per engine URL (engines known now, zeros included)."""
        with self._lock:
            return {e.url: self._queued.get((role, e.url), 0) for e in self._engines[role]}

    def pick(self, role: str, tokens: int, exclude: frozenset[str] = frozenset()) -> Engine:
        """The engine for a request of ``tokens``, queued on it until
        :meth:`release`; :class:`NoEngine` when the role has none (other
        than those whose URLs are in ``exclude``)."""
        with self._lock:
            engines = [e for e in self._engines[role] if e.url not in exclude]
            if not engines:
                other = " other than " + ", ".join(sorted(exclude)) if exclude else ""
                raise NoEngine(f"no {role} engine is registered{other}")
            everyone = self._engines[role]
            start = self._turn[role] % len(everyone)
            order = [e for e in everyone[start:] + everyone[:start] if e.url not in exclude]
            if self.policy == "least_loaded":
                chosen = min(order, key=lambda e: self._queued.get((role, e.url), 0))
            else:
                chosen = order[0]
            self._turn[role] = self._engines[role].index(chosen) + 1
            key = (role, chosen.url)
            self._queued[key] = self._queued.get(key, 0) + tokens
            return chosen

    def release(self, role: str, engine: Engine, tokens: int) -> None:
        with self._lock:
            key = (role, engine.url)
            left = self._queued.get(key, 0) - tokens
            if left > 0:
                self._queued[key] = left
            else:
                self._queued.pop(key, None)
