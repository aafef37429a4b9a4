"""Experiment tooling over many runs: families of runs and their comparisons.

sweep               `moe-jax sweep`: expand an experiment family (``configs/*.json``) into
                    runs, run them, collect their eval curves into tables and plots
routing_comparison  the last-eval table and bar chart of a routing sweep family
"""
