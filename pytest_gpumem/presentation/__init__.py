"""Renderers of the per-test records: the terminal table, Markdown, JUnit properties, benchmark JSON,
``gpumem diff`` and plots. None of them judges: they show what the record says."""
