"""The HTML report shows where two steps' transcripts first differ (as `pinned-eval compare`
does), every text escaped: a transcript is model output, so a `<script>` in it stays inert text."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

from app.report import comparison_html
from pinned_eval.results.compare import compare_samples
from pinned_eval.results.tables import generation_row, samples_table
from pinned_eval.rollout import Sample

SCRIPT = "<script>alert('pwned')</script>"


def _table(reply: str) -> Any:
    messages = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": reply}]
    sample = Sample(dataset="agent", prompt_index=0, sample_index=0, prompt="Name a prime.", label="7", metadata={},
                    response=reply, response_len=3, finish_reason="stop", weight_version="1", messages=messages,
                    turns=1, status="completed")
    return samples_table([{**generation_row(sample.model_dump()), "reward": 1.0}], key=None)


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.cells: list[list[str]] = []
        self._in: str | None = None
        self._row: list[str] = []

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self.tags.append(tag)
        if tag == "table" and ("class", "transcripts") in attrs:
            self._in = "transcripts"
        elif tag == "tr" and self._in:
            self._row = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._in and self._row:
            self.cells.append(self._row)
        if tag == "table":
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in and self.tags[-1] in ("td", "th"):
            self._row.append(data)


def test_the_report_shows_where_transcripts_differ_and_a_script_in_them_is_inert() -> None:
    [flips] = compare_samples(_table("\\boxed{7}"), _table(f"{SCRIPT} \\boxed{{7}}"))
    assert flips.lost == flips.gained == []  # same reward: only the transcripts tell them apart

    page = comparison_html(3, 4, [flips])

    parsed = _Page()
    parsed.feed(page)
    assert "script" not in parsed.tags
    assert parsed.cells == [["example", "turn", "role A", "A", "role B", "B"],
                            ["0", "1", "assistant", "\\boxed{7}", "assistant", f"{SCRIPT} \\boxed{{7}}"]]
    assert "&lt;script&gt;alert(&#x27;pwned&#x27;)&lt;/script&gt;" in page


def test_no_transcript_section_without_transcripts() -> None:
    [flips] = compare_samples(_table("\\boxed{7}"), _table("\\boxed{7}"))
    assert "transcripts" not in comparison_html(3, 4, [flips])
