"""Tests of the cli wing: the polyserve command."""
