"""The tests' chi-square helper is the project's own (specloop.samplers._stats)."""

from specloop.samplers._stats import chi2_statistic

__all__ = ["chi2_statistic"]
