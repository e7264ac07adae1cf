"""What an artifact's producers and consumers agree on: its files, the graph's step and cache
tensors (names, dtypes, shapes, allocation) and how an artifact is opened and checked.

Export, runtime, verification, the TensorRT plugins and the tests import this package; it
imports none of them (only the spec, the codecs and the error type).
"""
