"""Tests of the state wing: the data directory and what it writes."""
