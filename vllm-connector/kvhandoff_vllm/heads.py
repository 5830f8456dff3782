"""Engines of different tensor-parallel sizes: which ranks exchange which KV heads.

The agent's rules, in Python (transferagent/api/v1/heads.go; test_heads.py holds the two to
the same answers): each decode rank takes every KV head it holds from a prefill rank that
holds it, and each such rank pair is a transfer of its own, named by pair_request_id. A
request is delivered once every pair of the rank is.
"""

from __future__ import annotations


class ShardError(ValueError):
    """The model's KV heads neither split over nor replicate across a tensor-parallel size."""


def check_shards(kv_heads: int, size: int) -> None:
    if kv_heads <= 0 or size <= 0 or (kv_heads % size and size % kv_heads):
        raise ShardError(f"{kv_heads} KV heads neither split over nor replicate across tensor-parallel size {size}")


def rank_heads(kv_heads: int, size: int, rank: int) -> range:
    """The heads rank holds: kv_heads/size of them, or one replicated head (MLA's latent
    counts as one head)."""
    if kv_heads >= size:
        n = kv_heads // size
        return range(rank * n, rank * n + n)
    h = rank // (size // kv_heads)
    return range(h, h + 1)


def sources(kv_heads: int, p: int, d: int, decode_rank: int) -> list[int]:
    """The prefill ranks (of p) decode_rank (of d) takes its heads from, ascending; a head
    replicated on several prefill ranks is read from the one decode_rank picks, so that decode
    ranks spread over the replicas."""
    check_shards(kv_heads, p)
    check_shards(kv_heads, d)
    out: list[int] = []
    for h in rank_heads(kv_heads, d, decode_rank):
        holders = [i for i in range(p) if h in rank_heads(kv_heads, p, i)]
        i = holders[decode_rank % len(holders)]
        if not out or out[-1] != i:
            out.append(i)
    return out


def destinations(kv_heads: int, p: int, d: int, prefill_rank: int) -> list[int]:
    """The decode ranks (of d) prefill_rank (of p) feeds, ascending."""
    return [j for j in range(d) if prefill_rank in sources(kv_heads, p, d, j)]


def pair_request_id(request: str, prefill_rank: int, decode_rank: int, p: int, d: int) -> str:
    """One rank pair's name for a request: the request's own key when both engines have one
    size (rank r pairs with rank r), else "<key>#<prefill rank>><decode rank>"."""
    return request if p == d else f"{request}#{prefill_rank}>{decode_rank}"
