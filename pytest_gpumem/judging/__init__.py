"""Measurements -> verdicts: the limits (``verdict``), the stored baselines (``baseline``), the
predicted sizes (``predict``), the explanation of a failure (``explain``), one test's outcome (``gate``)
and the typed record every output is rendered from (``record``)."""
