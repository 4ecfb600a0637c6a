"""Tests of the master wing: the gunicorn master's hooks and life."""
