"""The site's build scripts (`gen_pages`, the figures, the tables, the hooks, the browser check).

With the repository root first on `sys.path` (as `docs/gen_pages.py` and the tests put it), they import
one another as `docs.<name>`: `from docs import figures`. None of them is site content (`exclude_docs`).
"""
