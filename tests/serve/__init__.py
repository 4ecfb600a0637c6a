"""Tests of the serve wing: the request path in a worker."""
