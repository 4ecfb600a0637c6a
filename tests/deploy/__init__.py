"""Tests of the deploy wing: the writes, dependency sets, validation and its sandbox."""
