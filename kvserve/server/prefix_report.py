"""The prefix-cache report: over recent traffic, the requests that share a long prefix, diverge at one point,
and then re-converge: a date, a session id or a request counter inside the system prompt (the classic
byte-sensitivity pitfall: the cache matches prefixes, so everything after the first differing token is
computed again for every request).

For each group it gives the diverging text (each request's varying span, decoded), the shared tokens after
it that the cache cannot reuse, what that costs per request, and the hit rate the group would get with the
varying part moved to the end of the prompt. Served as GET /debug/prefix-cache/report and logged
periodically (--prefix-report-interval).

Detection, per group of prompts that begin alike (their first ANCHOR tokens): each prompt against the
group's most recent one; they diverge where their common prefix ends, and re-converge at the first window of
RUN tokens, within MAX_GAP tokens of the divergence in both, that the two share again; the common run from
there is what the cache loses. Hits count whole blocks, never a prompt's last token (as admission does).
"""
from __future__ import annotations

import statistics
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

ANCHOR = 16
"""Prompts are grouped by their first this many tokens."""
RUN = 16
"""Tokens two prompts must share again, after diverging, to count as re-converged."""
MAX_GAP = 64
"""Longest varying span looked for (a date, an id, a timestamp)."""
MIN_LOST = 32
"""Re-converged runs shorter than this are not worth reporting."""


@dataclass(frozen=True)
class RecentPrompt:
    token_ids: list[int] | array
    text: str | None
    time: float


class RecentPrompts:
    """A bounded ring of the latest prompts (ids packed 4 bytes each: a full ring of long prompts stays small)."""

    def __init__(self, capacity: int = 256, clock: Callable[[], float] = time.monotonic):
        self._ring: deque[RecentPrompt] = deque(maxlen=capacity)
        self._clock = clock
        self._last_log = clock()

    def record(self, token_ids: list[int], text: str | None) -> None:
        self._ring.append(RecentPrompt(array("i", token_ids), text, self._clock()))

    def snapshot(self) -> list[RecentPrompt]:
        return list(self._ring)

    def log_due(self, interval_s: float) -> bool:
        """Whether a periodic log line is due (and, if so, the next one is interval_s from now)."""
        now = self._clock()
        if interval_s <= 0 or now - self._last_log < interval_s:
            return False
        self._last_log = now
        return True


@dataclass
class _Match:
    prompt: RecentPrompt
    diverge_at: int
    """Tokens shared with the group's reference before the first difference."""
    span: tuple[int, int]
    """This prompt's varying tokens [start, end)."""
    reference_span: tuple[int, int]
    reconverged: int
    """Tokens shared again from the end of the varying span."""


@dataclass
class Divergence:
    num_requests: int
    shared_prefix_tokens: int
    """Median tokens the group shares before the varying part."""
    varying_text: list[str]
    """The varying span of a few requests, decoded (token ids where there is no tokenizer)."""
    varying_tokens: int
    """Median length of the varying span."""
    reconverged_tokens: int
    """Median tokens shared again after it: computed anew by every request."""
    tokens_lost_per_request: float
    """Mean prompt tokens, per request after the group's first, the cache would serve with the varying part moved
    to the end and does not now (whole blocks)."""
    hit_rate_now: float
    hit_rate_if_moved: float
    """Over the group's prompt tokens: what the cache serves now, and with the varying part at the end."""
    context_before: str = ""
    """The text of the 24 tokens before the varying span (where in the prompt it is)."""

    def log_line(self, with_text: bool) -> str:
        """One line for the server log; the varying text only with_text (it is the clients' prompt text)."""
        sample = f" ({' | '.join(t[:40] for t in self.varying_text[:3])!r})" if with_text else ""
        return (f"prefix cache: {self.num_requests} recent requests share {self.shared_prefix_tokens} tokens, then "
                f"differ in {self.varying_tokens}{sample} and share {self.reconverged_tokens} more: "
                f"{self.tokens_lost_per_request:.0f} tokens recomputed per request; hit rate "
                f"{self.hit_rate_now:.0%} now, {self.hit_rate_if_moved:.0%} with the varying part at the end "
                "of the prompt (GET /debug/prefix-cache/report)")


def _common_len(a, i: int, b, j: int) -> int:
    """Length of the common run of a[i:] and b[j:] (slice comparisons, so C loops: a binary search)."""
    lo, hi = 0, min(len(a) - i, len(b) - j)
    while lo < hi:  # invariant: the first lo tokens are equal
        mid = (lo + hi + 1) // 2
        if a[i:i + mid] == b[j:j + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _hit(num_shared: int, prompt_len: int, block_size: int) -> int:
    return min(num_shared, prompt_len - 1) // block_size * block_size


def _reconverge(ref: list[int], ids: list[int], start: int) -> tuple[int, int, int] | None:
    """The first window of RUN tokens the two share again within MAX_GAP of `start`: (end of ref's varying
    span, end of ids's, tokens shared from there), or None."""
    windows: dict[tuple[int, ...], int] = {}
    for i in range(start + 1, min(start + MAX_GAP, len(ref) - RUN) + 1):
        windows.setdefault(tuple(ref[i:i + RUN]), i)
    for j in range(start + 1, min(start + MAX_GAP, len(ids) - RUN) + 1):
        i = windows.get(tuple(ids[j:j + RUN]))
        if i is not None:
            return i, j, _common_len(ref, i, ids, j)
    return None


def _match(ref: RecentPrompt, prompt: RecentPrompt) -> _Match | None:
    a, b = ref.token_ids, prompt.token_ids
    p = _common_len(a, 0, b, 0)
    if p == min(len(a), len(b)):
        return None  # one prefixes the other: nothing diverges
    found = _reconverge(a, b, p)
    if found is None or found[2] < MIN_LOST:
        return None
    i, j, run = found
    return _Match(prompt, p, (p, j), (p, i), run)


def _groups(prompts: list[RecentPrompt]) -> list[list[RecentPrompt]]:
    by_anchor: dict[tuple[int, ...], list[RecentPrompt]] = {}
    for p in prompts:
        if len(p.token_ids) > ANCHOR + RUN:
            by_anchor.setdefault(tuple(p.token_ids[:ANCHOR]), []).append(p)
    return [g for g in by_anchor.values() if len(g) >= 2]


def _divergence(group: list[RecentPrompt], block_size: int, decode) -> Divergence | None:
    ref = group[-1]  # the most recent: the layout the clients send today
    matches = [m for m in (_match(ref, p) for p in group[:-1]) if m is not None]
    if not matches:
        return None
    first = matches[0]
    matches.append(_Match(ref, first.diverge_at, first.reference_span, first.span, first.reconverged))
    total = sum(len(m.prompt.token_ids) for m in matches)
    # NOTE: the first request of the group computes everything in either layout: it gains nothing.
    rest = matches[1:]
    now = sum(_hit(m.diverge_at, len(m.prompt.token_ids), block_size) for m in rest)
    moved = sum(_hit(m.diverge_at + m.reconverged, len(m.prompt.token_ids), block_size) for m in rest)
    texts = []
    for m in matches[::-1][:3]:  # the most recent first
        ids = list(m.prompt.token_ids[m.span[0]:m.span[1]])
        texts.append(decode(ids) if decode is not None else str(ids))
    before = list(ref.token_ids[max(0, first.diverge_at - 24):first.diverge_at])
    return Divergence(
        num_requests=len(matches),
        shared_prefix_tokens=int(statistics.median(m.diverge_at for m in matches)),
        varying_text=texts,
        varying_tokens=int(statistics.median(m.span[1] - m.span[0] for m in matches)),
        reconverged_tokens=int(statistics.median(m.reconverged for m in matches)),
        tokens_lost_per_request=(moved - now) / len(rest),
        hit_rate_now=now / total, hit_rate_if_moved=moved / total,
        context_before=decode(before) if decode is not None else str(before))


def find_divergences(prompts: list[RecentPrompt], block_size: int,
                     decode: Callable[[list[int]], str] | None = None) -> list[Divergence]:
    """Groups of recent prompts whose shared prefix is cut by a varying span, costliest first."""
    found = [d for d in (_divergence(g, block_size, decode) for g in _groups(prompts)) if d is not None]
    return sorted(found, key=lambda d: -d.tokens_lost_per_request * d.num_requests)


@dataclass
class Report:
    num_prompts: int
    block_size: int
    divergences: list[Divergence] = field(default_factory=list)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {"object": "prefix_cache.report", "recent_prompts": self.num_prompts, "block_size": self.block_size,
                "divergences": [asdict(d) for d in self.divergences],
                "advice": ("move the varying text (dates, ids, counters) to the end of the prompt, after the "
                           "shared instructions, so every request reuses the shared part")
                          if self.divergences else "no diverging prefixes in recent traffic"}


def build_report(recent: RecentPrompts, block_size: int, decode=None) -> Report:
    prompts = recent.snapshot()
    return Report(len(prompts), block_size, find_divergences(prompts, block_size, decode))
