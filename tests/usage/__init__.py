"""Tests of the usage wing: the meter and the usage answer."""
