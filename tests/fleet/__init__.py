"""Tests of the fleet wing: many hosts around one PostgreSQL."""
