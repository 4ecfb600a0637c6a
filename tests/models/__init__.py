"""Tests of the models wing: what spaces import."""
