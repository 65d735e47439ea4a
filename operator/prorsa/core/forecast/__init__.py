"""Appendix B of the paper: the trajectory table, duration statistics and the forecast."""
