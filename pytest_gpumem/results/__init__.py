"""What a launch measured, the one type every layer above reads: each rank's peak at one world size
(``size``), a figure fitted for a size not launched (``predict``), and what a measurement stood on
(``provenance``)."""
