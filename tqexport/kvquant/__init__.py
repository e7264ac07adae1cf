"""Pure KV-cache formats: dtype registry, TurboQuant layout, reference codecs (no models)."""
