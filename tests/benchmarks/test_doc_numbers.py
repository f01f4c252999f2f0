"""``benchmarks.doc_numbers``: every ``elixir-plan`` figure the docs quote is ``elixir-plan``'s output
(in-process, offline, the shipped H100 profile): a stale one is found, named and rewritten."""

from __future__ import annotations

import pytest

from benchmarks import doc_numbers
from benchmarks.doc_numbers import COLUMNS, DOCS, MEASURED_OVER, PLANS, QUOTE, ROOT, TABLES, Table, stale, write

TINY = ("--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--gpu", "h100", "--host-mem", "8GiB")


def _quoted_names() -> list[str]:
    return [m["name"] for path in DOCS for m in QUOTE.finditer((ROOT / path).read_text())]


def test_every_quote_names_a_table_or_a_plan_s_figure() -> None:
    names = _quoted_names()
    assert set(TABLES) <= set(names), "a table no file quotes"
    figures = [n for n in names if n not in TABLES]
    for name in figures:
        plan, _, column = name.partition(":")
        assert plan in PLANS and (column in COLUMNS or column.startswith(f"{MEASURED_OVER}=")), name
    rows = {p for t in TABLES.values() if isinstance(t, Table) for p, _ in t.rows}
    assert {n.partition(":")[0] for n in figures} | rows == set(PLANS)


def test_a_stale_figure_is_found_and_rewritten(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(PLANS, "tiny", TINY)
    monkeypatch.setattr(doc_numbers, "DOCS", ("doc.md",))
    doc = doc_numbers.plan_doc(TINY)
    step = f"{doc['plan']['predicted']['total']:.2f} s"
    text = "a step of <!-- elixir-plan: tiny:step -->9.99 s<!-- /elixir-plan -->, {} chunks: <!-- elixir-plan: tiny:n_chunks -->{}<!-- /elixir-plan -->\n"
    n_chunks = doc["plan"]["n_chunks"]
    (tmp_path / "doc.md").write_text(text.format(n_chunks, n_chunks))
    diff = stale("doc.md", tmp_path)
    assert (
        "-a step of <!-- elixir-plan: tiny:step -->9.99 s" in diff
        and f"+a step of <!-- elixir-plan: tiny:step -->{step}" in diff
    )
    assert write("doc.md", tmp_path) and not stale("doc.md", tmp_path)
    assert (tmp_path / "doc.md").read_text() == text.format(n_chunks, n_chunks).replace("9.99 s", step)
    assert not write("doc.md", tmp_path)  # as elixir-plan says: nothing to rewrite


def test_an_unknown_figure_names_what_there_is(tmp_path) -> None:
    (tmp_path / "doc.md").write_text("<!-- elixir-plan: llama-b8:speed -->1<!-- /elixir-plan -->")
    with pytest.raises(KeyError, match="a PLAN:COLUMN of .*'llama-b8'.*'tflops'"):
        stale("doc.md", tmp_path)


@pytest.mark.slow  # every quoted plan: 7-70 B models, ~60 plans, 9 steps profiled: a minute on 2 cores
@pytest.mark.parametrize("path", DOCS)
def test_the_docs_quote_elixir_plan(path: str) -> None:
    diff = stale(path)
    assert not diff, (
        f"{path} quotes other figures than elixir-plan's (python -m benchmarks.doc_numbers --write):\n{diff}"
    )
