"""Tests of the autoscale wing: ratios, decisions, the loop and the providers."""
