"""Capacity planning: sweeps of many simulations, SLO search, plots and a report."""
