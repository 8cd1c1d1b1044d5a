"""Measurements -> verdicts: the limits (``verdict``), the stored baselines (``baseline``), the
explanation of a failure (``explain``, ``growth``) and the typed record every output is rendered
from (``record``, built once by ``assemble``)."""
