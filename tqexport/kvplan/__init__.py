"""Which cache each layer gets: the request resolved per layer (``resolve``), what a build fits
on calibration text (``fitting``: scales, key transforms), the ``--kv-bits`` plan over measured
layer costs (``kv_budget``, ``calibration``, ``calibration_sim``) and the bits a plan holds
(``storage_bits``)."""
