"""The real-engine suite (pytest marker ``real_engine``; ``make test-engine``)."""
