"""The real-engine suite (marked ``real_engine``; ``make test-engine``)."""
