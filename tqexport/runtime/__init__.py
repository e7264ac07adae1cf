"""Serving an artifact: cache allocation from the spec, step building, backends."""
