"""Helpers shared by the test areas (real subprocess servers on loopback)."""
