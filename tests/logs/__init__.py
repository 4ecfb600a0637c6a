"""Tests of the logs wing: what spaces say, and its files."""
