"""Weighted mixtures of sources: the closed-form schedule, each source's epochs inside the
mixture's, its state, its resume (as saved, reweighted, elastic), and reading a mixed stream."""
