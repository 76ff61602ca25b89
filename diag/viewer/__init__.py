"""Reads incident directories and writes merged cross-rank flame graphs and summaries."""
