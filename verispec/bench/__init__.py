"""Benchmarks: prompt sets, spec-on vs spec-off measurement, reports and plots."""
