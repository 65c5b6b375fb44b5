"""The runs of the pages in ``doc_commands.PART2`` (tests/test_doc_commands.py has the others,
the extraction and the templates): a file of its own so that ``--dist loadfile`` can give it to
the other xdist worker."""

from __future__ import annotations

import pytest

from doc_commands import PART2, RUN_PAGES, page_params, run_page


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", page_params([p for p in RUN_PAGES if p.name in PART2]))
def test_each_command_on_the_page_runs(page, cache_dir, tmp_path):
    """One page's runnable commands, in order, in one scratch folder: each exits 0."""
    run_page(page, cache_dir, tmp_path)
