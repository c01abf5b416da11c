"""Prefix-affinity routing of paged-serve replicas under Ray Serve (serve/ray_deployment.py).

A replica's prefix cache holds the KV blocks of the prompts it served, so a request whose
prompt starts like an earlier one (a shared system prompt, a conversation's history) prefills
only its new tail on the replica that served the earlier one.  :class:`PrefixAffinityRouter`
is a Ray Serve ``RequestRouter``: it remembers, for the chained hashes of each prompt's
leading ``chunk_chars``-character chunks, the replica the prompt went to, and sends a new
request to the replica holding its longest remembered prefix, unless that replica's queue is
``imbalance`` requests longer than the shortest one; without a remembered prefix (or past the
imbalance) Ray's queue-length probing picks the least loaded replica.
"""

from __future__ import annotations

import json
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-paged-replica"  # names the replica that answered; in a request, pins one


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request as the ingress hands it to a replica: the ASGI essentials, the text
    the router matches prefixes on, and the replica the client pinned (if any)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    key: str = ""
    pin: str | None = None


def routing_key(path: str, body: bytes) -> str:
    """The prompt's text as the router matches it: a completion's prompt (its first, when
    several; token ids as text), or a chat's messages in order; "" when the body has none
    (the request then goes to the least loaded replica)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    if path.endswith("/chat/completions"):
        return _messages_key(data.get("messages"))
    if path.endswith("/completions"):
        return _prompt_key(data.get("prompt"))
    return ""


def _prompt_key(prompt) -> str:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(map(str, prompt))
    return ""


def _messages_key(messages) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            break
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text, in order
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role')}\x1f{content if isinstance(content, str) else ''}\x1e")
    return "".join(parts)


def prefix_hashes(key: str, chunk_chars: int) -> list[int]:
    """The chained hash of each whole leading chunk of ``key``: entry i stands for the first
    (i + 1) * chunk_chars characters."""
    out, h = [], 0
    for start in range(0, len(key) - chunk_chars + 1, chunk_chars):
        h = hash((h, key[start:start + chunk_chars]))
        out.append(h)
    return out


class PrefixTable:
    """Prefix hash -> replica id, the most recently used ``capacity`` entries."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.owners: OrderedDict[int, str] = OrderedDict()

    def owner(self, hashes: list[int], alive: set[str]) -> str | None:
        """The replica holding the longest of ``hashes`` among ``alive``."""
        for h in reversed(hashes):
            rid = self.owners.get(h)
            if rid in alive:
                self.owners.move_to_end(h)
                return rid
        return None

    def record(self, hashes: list[int], rid: str) -> None:
        for h in hashes:
            self.owners[h] = rid
            self.owners.move_to_end(h)
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)


def _forwarded(pending: PendingRequest | None) -> Forwarded | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    # by its fields: Ray may ship this router by value, with a Forwarded class of its own
    if type(first).__name__ == Forwarded.__name__ and hasattr(first, "key"):
        return first
    return None


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: pinned replica, else prefix affinity, else least loaded."""

    def initialize_state(self, chunk_chars: int = 64, imbalance: int = 8,
                         capacity: int = 65536, **_ignored):
        self.chunk_chars, self.imbalance = int(chunk_chars), int(imbalance)
        self.table = PrefixTable(int(capacity))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        fwd = _forwarded(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if fwd is None:
            return [candidate_replicas]
        if fwd.pin in by_id:
            return [[by_id[fwd.pin]]]
        rid = self.table.owner(prefix_hashes(fwd.key, self.chunk_chars), set(by_id))
        if rid is None or self._overloaded(rid, by_id):
            return self._least_loaded(candidate_replicas)
        return [[by_id[rid]], [r for k, r in by_id.items() if k != rid]]

    def _least_loaded(self, replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
        """One replica per rank, shortest known queue first; ties in random order, so idle
        replicas share the requests (a replica never probed yet counts as idle)."""
        cache = self.replica_queue_len_cache
        ranked = sorted(replicas, key=lambda r: (cache.get(r.replica_id) or 0, random.random()))
        return [[r] for r in ranked]

    def _overloaded(self, rid: str, by_id: dict[str, RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        lens = {k: cache.get(r.replica_id) for k, r in by_id.items()}
        known = [n for n in lens.values() if n is not None]
        mine = lens.get(rid)
        return mine is not None and bool(known) and mine - min(known) > self.imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        fwd = _forwarded(pending_request)
        if fwd is not None and fwd.key:
            self.table.record(prefix_hashes(fwd.key, self.chunk_chars), replica_id.unique_id)
