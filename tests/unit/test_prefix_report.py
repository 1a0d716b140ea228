"""The prefix-cache report on synthetic prompts: a date varying inside the system prompt is found, with its
text, the tokens it costs each request and the hit rate the group would get with the date moved to the end."""
from __future__ import annotations

from kvserve.server.prefix_report import RecentPrompts, build_report

BS = 16
WORDS: dict[str, int] = {}


def _ids(text: str) -> list[int]:
    return [WORDS.setdefault(w, len(WORDS) + 1) for w in text.split()]


def _decode(ids: list[int]) -> str:
    names = {v: k for k, v in WORDS.items()}
    return " ".join(names[i] for i in ids)


INTRO = " ".join(f"intro{i}" for i in range(20))       # 20 tokens shared before the date
RULES = " ".join(f"rule{i}" for i in range(100))       # 100 tokens shared after it


def _prompt(day: int, n: int) -> list[int]:
    return _ids(f"{INTRO} 2024-05-{day:02d} T{day} {RULES} " + " ".join(f"q{n}-{i}" for i in range(10)))


def test_a_date_in_the_system_prompt_is_found_and_its_cost_computed():
    recent = RecentPrompts(capacity=16)
    for n in range(6):
        recent.record(_prompt(n + 1, n), None)
    recent.record(_ids(" ".join(f"other{i}" for i in range(40))), None)  # unrelated traffic
    report = build_report(recent, BS, _decode)
    (d,) = report.divergences
    assert d.num_requests == 6
    assert d.shared_prefix_tokens == 20 and d.varying_tokens == 2 and d.reconverged_tokens == 100
    assert d.varying_text[0] == "2024-05-06 T6"  # the most recent request's date first
    assert "2024-05-05 T5" in d.varying_text
    # now: 16 of each prompt's 132 tokens hit (one block of the intro); moved: 112 (intro + rules, 7 blocks)
    assert d.tokens_lost_per_request == 112 - 16
    assert d.hit_rate_now == 5 * 16 / (6 * 132)
    assert d.hit_rate_if_moved == 5 * 112 / (6 * 132)
    assert d.context_before.endswith("intro19")
    body = report.to_dict()
    assert body["recent_prompts"] == 7 and body["divergences"][0]["tokens_lost_per_request"] == 96
    assert "2024-05-06" in d.log_line(with_text=True) and "2024-05-06" not in d.log_line(with_text=False)


def test_prompts_that_only_differ_at_the_end_are_not_reported():
    recent = RecentPrompts()
    for n in range(4):
        recent.record(_ids(f"{INTRO} {RULES} question{n} mark{n}"), None)
    report = build_report(recent, BS)
    assert report.divergences == []
    assert report.to_dict()["advice"] == "no diverging prefixes in recent traffic"


def test_the_ring_is_bounded_and_the_log_line_periodic():
    now = [0.0]
    recent = RecentPrompts(capacity=3, clock=lambda: now[0])
    for n in range(5):
        recent.record([n] * 4, None)
    assert [p.token_ids[0] for p in recent.snapshot()] == [2, 3, 4]
    assert not recent.log_due(60)
    now[0] = 61.0
    assert recent.log_due(60) and not recent.log_due(60)
    assert not recent.log_due(0)
