"""Verification of a built artifact against the torch reference (``tqexport parity``)."""
