"""Tests of the http wing: the door."""
