"""This project's benchmark report (``docs/report``): what it says of ``tqexport bench`` runs and
the goals it judges them by. Run from the repository: ``python -m benchmarks.report``."""
