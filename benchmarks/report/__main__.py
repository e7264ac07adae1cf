"""``python -m benchmarks.report``: the report command (:mod:`benchmarks.report.command`)."""

from benchmarks.report.command import main

main()
