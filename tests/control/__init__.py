"""Tests of the control wing: the control plane under /_polyserve."""
